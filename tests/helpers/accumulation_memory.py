"""Bytes of live tensors between the microbatches of one FSDP step: Kiln's accumulation (reduce-
scatter every microbatch) against FSDP2's no-sync mode, on the Trainer's own model and batch.

    torchrun --nproc-per-node 2 tests/helpers/accumulation_memory.py --config ... [overrides]

Prints, on rank 0, one line per mode: `<mode> grown <bytes> full_grads <bytes>`, where grown is
how much the live tensors grew from before the first microbatch to after its backward.
"""

import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from components.config.loading import load_config
from components.runtime.distributed import exit_cleanly, init_distributed
from parallelisms.fsdp import set_gradient_sync  # noqa: E402
from train import Trainer  # noqa: E402


def live_tensor_bytes() -> int:
    """Bytes of every distinct storage behind a live tensor or its gradient (parameters, gradients,
    FSDP's buffers): an allocator-independent measure that works on CPU."""
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type == "meta":
                continue
            tensors = [obj._local_tensor] if hasattr(obj, "_local_tensor") else [obj]
            if obj.grad is not None:  # a gradient Python never touched has no object of its own
                tensors.append(obj.grad._local_tensor if hasattr(obj.grad, "_local_tensor") else obj.grad)
            for t in tensors:
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen and storage.nbytes():
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        except (RuntimeError, ReferenceError, AttributeError):
            continue
    return total


def first_microbatch_growth(trainer: Trainer, kiln: bool) -> int:
    model = trainer.model.parts[0]
    (x, y), *_ = trainer.data.loader.batch(1)
    before = live_tensor_bytes()
    if kiln:
        set_gradient_sync(model, last_microbatch=False)
    else:
        model.set_requires_gradient_sync(False)  # FSDP2's no-sync: unsharded gradients accumulate
    loss = trainer.train_step.loss_fn(model(x), y)
    loss.backward()
    del loss
    grown = live_tensor_bytes() - before
    model.set_requires_gradient_sync(True)
    for p in model.parameters():
        p.grad = None
    return grown


def main() -> None:
    cfg = load_config(sys.argv[1:])
    info = init_distributed(cfg.comm.timeout_seconds)
    trainer = Trainer(cfg, info)
    full_grads = sum(p.numel() * 4 for p in trainer.model.parts[0].parameters())  # fp32, unsharded
    for mode, kiln in (("kiln", True), ("no_sync", False)):
        grown = first_microbatch_growth(trainer, kiln)
        if info.is_main:
            print(f"{mode} grown {grown} full_grads {full_grads}", flush=True)
    exit_cleanly(0, trainer.dims.release)


if __name__ == "__main__":
    main()
