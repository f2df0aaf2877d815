"""Context parallel on one process: the head-tail sharding of positions, and the attention pair
kernels against plain matmuls (the CUDA ones on meta tensors).

The sharded attention against full attention over several processes, and CP checkpoints across
layouts, are tests/e2e/test_context_parallel_runs.py; training parity of every CP layout with the
single process is test_parity.py; bad input test_errors_runs.py.
"""

import pytest


def test_head_tail_positions():
    from components.runtime.errors import KilnError
    from parallelisms.context_parallel import head_tail_positions

    shards = [head_tail_positions(16, 2, r).tolist() for r in range(2)]
    assert shards == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    every = sorted(p for r in range(4) for p in head_tail_positions(32, 4, r).tolist())
    assert every == list(range(32))
    with pytest.raises(KilnError, match="divisible"):
        head_tail_positions(30, 4, 0)


def _math_pair(q, k, v, dout, causal: bool):  # noqa: ANN001, ANN202
    """The reference: a pair's output, log-sum-exp and gradients by plain matmuls (the [c, c] score
    matrix the fused kernels never hold)."""
    import torch

    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones_like(s[0, 0], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ v
    out.backward(dout)
    return out.detach(), lse.detach(), (q.grad, k.grad, v.grad)


@pytest.mark.parametrize("causal", [False, True])
def test_pair_kernel_equals_plain_attention(causal):
    """The CPU pair kernel's output, log-sum-exp, and gradients from a given output and log-sum-exp
    equal the plain-matmul reference."""
    import torch

    from parallelisms.attention_kernels import choose_kernel, pair_backward, pair_forward

    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, 8, 16, generator=gen) for _ in range(4))
    assert choose_kernel(q, v) == "cpu_flash"
    out, lse, kernel = pair_forward(q, k, v, causal)
    want_out, want_lse, want_grads = _math_pair(q, k, v, dout, causal)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    for got, want in zip(pair_backward(dout, q, k, v, out, lse, causal, kernel), want_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_cuda_pair_kernels_take_what_they_return(kernel):
    """The CUDA kernels' calls on meta tensors (torch's shape functions, no GPU needed): forward gives
    an output and an unpadded fp32 log-sum-exp per query, and backward accepts the merged
    log-sum-exp and what forward returned, giving gradients of q, k, v's shapes."""
    import torch

    from parallelisms.attention_kernels import pair_backward, pair_forward

    q, k, v = (torch.empty(2, 4, 40, 64, dtype=torch.bfloat16, device="meta") for _ in range(3))
    out, lse, saved = pair_forward(q, k, v, True, kernel=kernel)
    assert saved.name == kernel and out.shape == q.shape
    assert lse.shape == (2, 4, 40) and lse.dtype == torch.float32
    grads = pair_backward(torch.empty_like(out), q, k, v, out, lse.clone(), True, saved)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
