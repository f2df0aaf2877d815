"""Context parallel: the sharded attention equals full attention, and CP checkpoints move across layouts.

Training parity of every CP layout with the single process is in test_parity.py; bad input in
test_errors.py.
"""

import shutil

import pytest
from conftest import TINY, check_ok, run_train, train_rows

CP2 = ["--parallelism.context_parallel_degree", "2"]


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_matches_full_attention(cp):
    """Output and q/k/v gradients of both rotate methods (allgather through funcol's all-gather and
    through the gloo accelerations' overlapped broadcasts; MHA and GQA) within 1e-5 of full SDPA."""
    proc = run_train([], nproc=cp, script="tests/helpers/cp_attention_check.py")
    check_ok(proc)
    lines = [line for line in proc.stdout.splitlines() if "max abs diff" in line]
    assert len(lines) == 9, proc.stdout  # 3 routes × 3 head layouts, each checked
    assert all(line.startswith(f"cp {cp} ") for line in lines)


def test_head_tail_positions():
    from components.runtime.errors import KilnError
    from parallelisms.context_parallel import head_tail_positions

    shards = [head_tail_positions(16, 2, r).tolist() for r in range(2)]
    assert shards == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    every = sorted(p for r in range(4) for p in head_tail_positions(32, 4, r).tolist())
    assert every == list(range(32))
    with pytest.raises(KilnError, match="divisible"):
        head_tail_positions(30, 4, 0)


def _ckpt_args(dump, data_cache, steps: int) -> list[str]:
    return [*TINY, "--training.steps", str(steps), "--checkpoint.enable", "--checkpoint.interval", "5",
            "--job.dump_folder", str(dump), "--training.data_cache_dir", str(data_cache)]


@pytest.mark.parametrize("first,then", [(2, 1), (1, 2)], ids=["cp2_to_single", "single_to_cp2"])
def test_resume_across_cp(first, then, tmp_path, data_cache):
    """A checkpoint written with CP 2 resumes in one process, and one from one process under CP 2:
    the continuation matches the uninterrupted run."""
    straight = tmp_path / "straight"
    check_ok(run_train(_ckpt_args(straight, data_cache, 10) + (CP2 if first == 2 else []), nproc=first))
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(straight / "checkpoint" / "step-5", resumed / "checkpoint" / "step-5")
    proc = run_train(_ckpt_args(resumed, data_cache, 10) + (CP2 if then == 2 else []), nproc=then)
    check_ok(proc)
    assert "step-5" in proc.stdout
    ref = {r["step"]: r for r in train_rows(straight)}
    got = {r["step"]: r for r in train_rows(resumed)}
    assert sorted(got) == list(range(6, 11))
    for step in range(6, 11):
        assert abs(got[step]["loss"] - ref[step]["loss"]) <= 1e-5 * ref[step]["loss"], step
        assert abs(got[step]["grad_norm"] - ref[step]["grad_norm"]) <= 1e-4 * ref[step]["grad_norm"], step


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


def test_exception_during_overlapped_gather_exits_cleanly():
    """An exception while the gloo accelerations' CP broadcasts or gradient all-to-all are in flight:
    both ranks go on (memory intact, the next attention right) and exit 0 — no double free."""
    proc = run_train([], nproc=2, script="tests/helpers/cp_exception_check.py")
    check_ok(proc)
    assert "ok" in proc.stdout.splitlines()
    assert "double free" not in proc.stderr and "corruption" not in proc.stderr
