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
    """Output and q/k/v gradients of both rotate methods (allgather on gloo's overlapped route and on
    NCCL's funcol route; MHA and GQA) within 1e-5 of full SDPA."""
    proc = run_train([], nproc=cp, script="tests/helpers/cp_attention_check.py")
    check_ok(proc)
    lines = [line for line in proc.stdout.splitlines() if "max abs diff" in line]
    assert len(lines) == 9, proc.stdout  # 3 routes × 3 head layouts, each checked
    assert all(line.startswith(f"cp {cp} ") for line in lines)


def test_head_tail_positions():
    from components.errors import KilnError
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


@pytest.mark.parametrize("causal", [False, True])
def test_block_kernels_fused_and_plain_agree(causal):
    """The plain-matmul pair kernels (used off CPU) equal torch's CPU flash kernels: output,
    log-sum-exp, and the gradients from a given output and log-sum-exp."""
    import torch

    from parallelisms.blockwise_attention import _block_backward, _block_forward

    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, 8, 16, generator=gen) for _ in range(4))
    fused_out, fused_lse = _block_forward(q, k, v, causal, fused=True)
    plain_out, plain_lse = _block_forward(q, k, v, causal, fused=False)
    torch.testing.assert_close(plain_out, fused_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain_lse, fused_lse, atol=1e-5, rtol=1e-5)
    fused = _block_backward(dout, q, k, v, fused_out, fused_lse, causal, fused=True)
    plain = _block_backward(dout, q, k, v, fused_out, fused_lse, causal, fused=False)
    for a, b in zip(plain, fused, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-5, rtol=1e-5)
    # And both are the gradients of ordinary attention.
    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(ref_q, ref_k, ref_v, is_causal=causal)
    ref.backward(dout)
    for got, want in zip(fused, (ref_q.grad, ref_k.grad, ref_v.grad), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
