"""The planner's memory accounting on one process: the measured CPU peak sees frees on other threads,
a reduction into another dtype counts its copy of the input on CPU, and the plan runner keeps each
result in its task's place. The planner against real runs, and its command line, are
tests/e2e/test_plan_runs.py."""

import contextlib
import time

import pytest


def test_the_measured_cpu_peak_sees_frees_on_other_threads():
    # gloo frees blocks on its worker threads, where torch.profiler records no event: the report
    # reads the allocator's own total over every thread, so a block freed there is gone at once.
    import threading

    import torch

    from components.observability.memory_report import AllocatorTotals, cpu_allocator_totals, window_peak

    mib = 1 << 20
    totals = AllocatorTotals()
    totals.start()
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    profiler.start()
    try:
        box = [torch.empty(4 * mib, dtype=torch.uint8)]
        worker = threading.Thread(target=box.clear)
        worker.start()
        worker.join()
        start = time.time_ns()
        kept = [torch.empty(2 * mib, dtype=torch.uint8), torch.empty(mib, dtype=torch.uint8)]
        end = time.time_ns()
    finally:
        profiler.stop()
        totals.stop()
    assert not totals.flag.value
    events = cpu_allocator_totals(profiler.profiler.kineto_results.experimental_event_tree())
    assert [delta for _, delta, _ in events if abs(delta) >= mib] == [4 * mib, 2 * mib, mib]  # no free seen
    assert window_peak(events, start, end) == 3 * mib  # the profiler's events summed: 7 MiB
    assert window_peak(events, end, end + 1) == 3 * mib  # nothing inside: what was held before
    del kept


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_a_reduction_into_another_dtype_counts_its_copy_of_the_input_on_cpu(device_type):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from planning.step_tracker import StepTracker

    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        grad = torch.empty(1 << 20)  # 4 MiB of float32
        tracker = StepTracker(fake, {}, device_type)
        with tracker:
            tracker.reset_peak()
            torch.linalg.vector_norm(grad, 2, dtype=torch.float64)  # the CPU grad-norm clip's
            torch.linalg.vector_norm(grad, 2)  # no cast: nothing beyond its output
    copy = (1 << 20) * 8 if device_type == "cpu" else 0
    assert tracker.peak == copy + 8


def _sleep_then_name(task: tuple) -> str:
    """Stands for a plan: sleeps task[0] seconds, returns task[1]."""
    time.sleep(task[0])
    return task[1]


def test_the_plan_runner_puts_each_result_in_its_task_place_whatever_ends_first(monkeypatch):
    import planning.plan as plan_module

    monkeypatch.setattr(plan_module, "_plan_task", _sleep_then_name)  # forked children see it
    tasks = [(0.5, "slow"), (0.0, "a"), (0.0, "b"), (0.0, "c")]
    assert plan_module._run_tasks(tasks, 2, keep_errors=True, start="fork") == ["slow", "a", "b", "c"]


def test_a_cuda_plan_runs_the_experts_as_cuda_does_and_a_cpu_plan_as_the_cpu_does(monkeypatch, tmp_path):
    # On CUDA in bf16 the experts take the grouped GEMM, on the CPU the loop (models/common/moe.py);
    # the planner's fake step takes the path of the device it plans for, and the grouped one plans.
    import planning.plan as plan_module
    from components.config.loading import load_config
    from models.common.moe import GroupedExperts
    from tests.helpers.runs import TINY

    log = tmp_path / "paths"
    for name in ("grouped_mm", "loop"):
        original = getattr(GroupedExperts, name)

        def noted(self, x, counts, _original=original, _name=name):
            with open(log, "a") as f:  # forked children write here
                f.write(f"{_name} {x.dtype}\n")
            return _original(self, x, counts)

        monkeypatch.setattr(GroupedExperts, name, noted)
    cfg = load_config([*TINY, "--model.name", "moe", "--training.global_batch_size", "8",
                       "--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"])
    results = {}
    for device_type in ("cuda", "cpu"):
        log.write_text("")
        [results[device_type]] = plan_module._run_tasks([(cfg, 2, 0, device_type, "none", True)], 1,
                                                       keep_errors=True, start="fork")
        assert not isinstance(results[device_type], BaseException), results[device_type]
        assert set(log.read_text().splitlines()) == (
            {"grouped_mm torch.bfloat16"} if device_type == "cuda" else {"loop torch.float32"})
    # the same expert-parallel exchange either way
    assert results["cuda"].calls == results["cpu"].calls
    # tensor parallel alone computes under autocast: float32 reaches the experts, which still take
    # the grouped GEMM (it casts), as a CUDA run does
    log.write_text("")
    tp = load_config([*TINY, "--model.name", "moe", "--training.global_batch_size", "8",
                      "--parallelism.tensor_parallel_degree", "2",
                      "--parallelism.data_parallel_shard_degree", "1"])
    [plan] = plan_module._run_tasks([(tp, 2, 0, "cuda", "none", True)], 1, keep_errors=True, start="fork")
    assert not isinstance(plan, BaseException), plan
    assert set(log.read_text().splitlines()) == {"grouped_mm torch.float32"}


def test_a_cuda_plans_attention_keeps_no_score_matrix_where_only_the_cpu_would():
    # Queries and values of different head dims (DeepSeek-V3's latent attention): the CPU computes
    # SDPA by its math path, which keeps [heads, seq, seq] scores for backward, where a CUDA run's
    # memory-efficient kernel keeps the output and log-sum-exp; a plan for CUDA runs that kernel.
    # Equal head dims stay with torch's own choice, the CPU's flash kernel. (Forward only: a fake
    # backward here would break the forked plans of the tests after it, see torch's Autograd-and-Fork.)
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from planning.cuda_attention import cuda_attention

    seq = 40  # unlike every head dim

    def attend(value_dim: int, planned_for_cuda: bool) -> tuple[str, set, tuple, torch.dtype]:
        kept = set()

        def keep(t: torch.Tensor) -> torch.Tensor:
            kept.add(tuple(t.shape))
            return t

        kernels = cuda_attention() if planned_for_cuda else contextlib.nullcontext()
        with FakeTensorMode(), kernels, torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            q, k = (torch.randn(1, 2, seq, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
            v = torch.randn(1, 2, seq, value_dim, dtype=torch.bfloat16, requires_grad=True)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.grad_fn.name(), kept, tuple(out.shape), out.dtype

    scores = (1, 2, seq, seq)
    cpu_node, cpu_kept, *cpu_out = attend(48, planned_for_cuda=False)
    assert scores in cpu_kept  # the math path
    cuda_node, cuda_kept, *cuda_out = attend(48, planned_for_cuda=True)
    assert cuda_node == "ScaledDotProductEfficientAttentionBackward0" and scores not in cuda_kept
    assert cuda_out == cpu_out == [(1, 2, seq, 48), torch.bfloat16]
    assert attend(64, planned_for_cuda=True)[0] == "ScaledDotProductFlashAttentionForCpuBackward0"
    assert F.scaled_dot_product_attention.__module__ == "torch._C._nn"  # put back


def test_a_cuda_plan_of_latent_attention_runs_cudas_kernel_and_a_cpu_plan_the_cpus(monkeypatch, tmp_path):
    # DeepSeek-V3's queries and values differ in head dim (tiny: 24 and 16): the plan for CUDA takes
    # planning/cuda_attention.py's kernel, the plan for the CPU torch's CPU path
    import planning.cuda_attention as cuda_attention
    import planning.plan as plan_module
    from components.config.loading import load_config

    log = tmp_path / "calls"
    needs = cuda_attention._needs_cuda_kernel

    def noted(*args):
        answer = needs(*args)
        with open(log, "a") as f:  # forked children write here
            f.write(f"{answer}\n")
        return answer

    monkeypatch.setattr(cuda_attention, "_needs_cuda_kernel", noted)
    cfg = load_config(["--config", "deepseek_v3_debug", "--model.flavor", "tiny", "--training.seq_len", "32",
                       "--training.global_batch_size", "2", "--training.local_batch_size", "2"])
    for device_type, calls in (("cuda", {"True"}), ("cpu", set())):
        log.write_text("")
        [plan] = plan_module._run_tasks([(cfg, 1, 0, device_type, "none", True)], 1, keep_errors=True,
                                        start="fork")
        assert not isinstance(plan, BaseException), plan
        assert set(log.read_text().splitlines()) == calls, device_type
