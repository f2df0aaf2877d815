"""gloo's all-gather and reduce-scatter beside the gloo accelerations'
(parallelisms/gloo_accelerations.py): ms per call by shard size. Run under torchrun
(benchmarks/benchmark.py --tables collectives does):

    torchrun --standalone --nproc-per-node 2 benchmarks/benchmark_collectives.py
"""

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parallelisms.gloo_accelerations import AllToAllReduceScatter, BroadcastAllGather  # noqa: E402


def ms_per_call(fn: Callable[[], None], calls: int = 20) -> float:
    """Median over 3 timed rounds (after a warm-up) of the mean ms per call, all ranks in step."""
    fn()
    rounds = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(rounds)


def _row(kib: int, world: int, group: dist.ProcessGroup) -> tuple[int, float, float, float, float]:
    """ms per call of gloo's and Kiln's all-gather and reduce-scatter of a kib-KiB shard."""
    shard = torch.randn(kib * 256)
    full = torch.empty(shard.numel() * world)
    gathered = torch.empty_like(full)
    return (kib, ms_per_call(lambda: dist.all_gather_into_tensor(gathered, shard)),
            ms_per_call(lambda: BroadcastAllGather()(gathered, shard, group)),
            ms_per_call(lambda: dist.reduce_scatter_tensor(shard, full)),
            ms_per_call(lambda: AllToAllReduceScatter()(shard, full, group, dist.ReduceOp.SUM)))


def main() -> None:
    dist.init_process_group("gloo")
    world, group = dist.get_world_size(), dist.group.WORLD
    rows = [_row(kib, world, group) for kib in (256, 1024, 4096)]
    if dist.get_rank() == 0:
        print(f"\ngloo collectives, {world} processes, float32, ms per call (median of 3 rounds of 20)\n")
        print("| shard per rank | all-gather | Kiln: broadcasts | reduce-scatter | Kiln: all-to-all + sum |")
        print("|---|---|---|---|---|")
        for kib, ag, bag, rs, ars in rows:
            print(f"| {kib} KiB | {ag:.2f} | {bag:.2f} | {rs:.2f} | {ars:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
