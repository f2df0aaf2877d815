"""The memory of Kiln's shard-only initialisation on each rank, measured.

    torchrun --nproc-per-node 2 tests/helpers/init_memory.py OUT.json --config ... [overrides]

Builds this rank's model parts on the meta device as the trainer does (training.assembly: build_layout and
build_model_parts, Kiln's parallelisms), then runs parallelisms/materialize.materialize_and_init
under torch.profiler's allocator recording. Rank 0 writes OUT.json, a list with one entry a rank:

    {"peak": the most bytes live at once during initialisation (the CPU allocator events torch.profiler
             records, paired by address: initialisation runs on this thread alone, no collective,
             so every free is seen),
     "kept": bytes this rank holds after it (its parameter shards and its buffers),
     "shards": the parameter shards' part of kept,
     "largest": bytes of the model's largest parameter, "model": bytes of all its parameters}
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from components.config.loading import load_config
from components.config.parallel_options import ParallelOptions
from components.runtime.distributed import exit_cleanly, init_distributed
from components.runtime.tensor_utils import local_tensor
from parallelisms.materialize import materialize_and_init  # noqa: E402
from training.assembly import build_layout, build_model_parts, load_model_family


def allocator_events(profiler: torch.profiler.profile) -> list[tuple[int, int, int]]:
    """(time ns, address, bytes: + allocated, - freed) of every CPU allocator event recorded, in order."""
    from torch._C._profiler import (
        _EventType,  # private to torch (as in components/observability/memory_report.py)
    )

    out, stack = [], list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            if fields.device.type == "cpu":
                out.append((event.start_time_ns, fields.ptr, fields.alloc_size))
            continue
        stack.extend(event.children)
    return sorted(out)


def peak_live(events: list[tuple[int, int, int]]) -> int:
    """The most bytes live at once among the blocks allocated while recording."""
    blocks: dict[int, int] = {}
    live = peak = 0
    for _, address, delta in events:
        if delta > 0:
            blocks[address] = delta
            live += delta
        else:
            live -= blocks.pop(address, 0)  # a block from before the recording is none of ours
        peak = max(peak, live)
    return peak


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind the tensors (a DTensor's local shard)."""
    storages = {local_tensor(t).untyped_storage().data_ptr(): local_tensor(t).untyped_storage().nbytes()
                for t in tensors}
    return sum(storages.values())


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    cfg = load_config(argv)
    info = init_distributed(cfg.comm.timeout_seconds)
    spec, args = load_model_family(cfg)
    options = ParallelOptions.from_config(cfg, info.device.type)
    dims, _ = build_layout(cfg, spec, args, info.world_size, options, info.device.type)
    dims.build_mesh(info.device.type)
    parts = build_model_parts(spec, args, dims, options).parts
    with torch.device("meta"):
        whole = spec.model_cls(args)
    sizes = [p.numel() * p.element_size() for p in whole.parameters()]

    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    profiler.start()
    for part in parts:
        materialize_and_init(part, lambda: spec.model_cls(args), cfg.training.seed, info.device)
    profiler.stop()
    shards = storage_bytes([p for part in parts for p in part.parameters()])
    buffers = storage_bytes([b for part in parts for b in part.buffers()])
    mine = {"peak": peak_live(allocator_events(profiler)), "kept": shards + buffers, "shards": shards,
            "largest": max(sizes), "model": sum(sizes)}
    every = [None] * info.world_size
    if dist.is_initialized():
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    if info.is_main:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(every, indent=1))
    exit_cleanly(0, dims.release)


if __name__ == "__main__":
    main()
