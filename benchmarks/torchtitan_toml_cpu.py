"""TorchTitan of the TOML-config generation (its last such commit, 238fa99 of 2026-02-23) on CPU,
through its own Trainer and its llama3 debug_model.toml: the second TorchTitan of the speed
comparison (benchmarks/speed.md says what differs from benchmarks/torchtitan_cpu.py, which runs
TorchTitan 0.3.0).

Its own defaults where they run on CPU: the `debugmodel` flavor (dim 256, 6 layers, 16 heads,
SwiGLU 768), plain cross-entropy (no chunked loss), FSDP only over more than one data-parallel
rank, SDPA attention. Set for the comparison: seq 128, local batch 4, fp32, no activation
checkpointing (the TOML's selective AC) unless --ac, Kiln's Shakespeare corpus, log every step.
--vocab 2048 is the flavor's own vocabulary, --vocab 4096 Kiln's (patched); --tokenizer must
fit it (default: Kiln's assets/tokenizer, 4096 tokens). Nothing here imports Kiln; the caller
sets OMP_NUM_THREADS=1 and runs it where that TorchTitan is installed:

    python3 -m venv /tmp/ttold && /tmp/ttold/bin/pip install torch==2.13.0 torchdata datasets \\
        tokenizers tomli fsspec tyro tensorboard einops pillow triton
    git clone https://github.com/pytorch/torchtitan /tmp/tt238 && git -C /tmp/tt238 checkout 238fa99
    /tmp/ttold/bin/pip install --no-deps -e /tmp/tt238
    /tmp/ttold/bin/python benchmarks/torchtitan_toml_cpu.py \
        --toml /tmp/tt238/torchtitan/models/llama3/train_configs/debug_model.toml

Prints the same JSON line as benchmarks/torchtitan_cpu.py ({"tps", "peak_rss_mib"}), timed the same
way. Patches (at run time): the device type (cpu, while torchtitan is imported), force-sum reduction
with TorchTitan's gradient divide factor of 1 (gloo has no PREMUL_SUM), peak RSS for its
CUDA-only memory monitor.
"""

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torchtitan_cpu import BATCH, REPO, SEQ, CpuModule, register_corpus, rss_monitor, train_and_report  # noqa: E402


def _patch_for_cpu(vocab: int) -> None:
    """Run the TOML-era TorchTitan on CPU/gloo; before any other torchtitan import."""
    import torch
    import torch._utils

    # Its modules copy the device type when imported, and importing any of them imports most:
    # torch's device lookup answers "cpu" while torchtitan loads.
    lookup = torch._utils._get_available_device_type, torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda _: CpuModule()
    try:
        import torchtitan.tools.utils  # noqa: F401
    finally:
        torch._utils._get_available_device_type, torch._utils._get_device_module = lookup
    import torchtitan.components.metrics as tt_metrics
    import torchtitan.models.llama3 as tt_llama3
    import torchtitan.models.llama3.infra.parallelize as tt_parallelize

    divide_by_one = tt_parallelize.disable_fsdp_gradient_division

    def sum_divided_by_one(model: torch.nn.Module) -> None:
        divide_by_one(model)
        for module in model.modules():
            if isinstance(module, tt_parallelize.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    tt_parallelize.disable_fsdp_gradient_division = sum_divided_by_one
    tt_metrics.build_device_memory_monitor = rss_monitor(tt_metrics)
    tt_llama3.llama3_args["debugmodel"].vocab_size = vocab


def _args(a: argparse.Namespace, dump: str) -> list[str]:
    """TorchTitan's command line: its debug TOML with the comparison's settings."""
    return ["--job.config_file", str(a.toml), "--job.dump_folder", dump, "--model.flavor", "debugmodel",
            "--model.hf_assets_path", str(a.tokenizer), "--training.dataset", "kiln_shakespeare",
            "--training.seq_len", str(SEQ), "--training.local_batch_size", str(BATCH),
            "--training.steps", str(a.steps), "--training.mixed_precision_param", "float32",
            "--activation_checkpoint.mode", "full" if a.ac else "none",
            "--parallelism.tensor_parallel_degree", str(a.tp),
            "--parallelism.pipeline_parallel_degree", str(a.pp),
            "--parallelism.pipeline_parallel_microbatch_size", "1",
            "--parallelism.data_parallel_replicate_degree", str(a.dp_replicate),
            "--metrics.log_freq", "1", "--metrics.disable_color_printing",
            *(["--compile.enable", "--compile.components", "model"] if a.compile else [])]


def _train(a: argparse.Namespace, scratch: str) -> tuple[list[float], int, int]:
    """Run the trainer; (end time of each step, global rows per step, rank)."""
    _patch_for_cpu(a.vocab)
    import torch.distributed as dist
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger, logger
    from torchtitan.train import Trainer

    class TimedTrainer(Trainer):
        """Records when each train step ends."""

        def train_step(self, data_iterator: Any) -> None:
            super().train_step(data_iterator)
            self.ends.append(time.perf_counter())

    init_logger()
    for handler in logger.handlers:
        handler.setStream(sys.stderr)  # stdout carries only the result line
    register_corpus("kiln_shakespeare", a.corpus)
    TimedTrainer.ends = []
    trainer = TimedTrainer(ConfigManager().parse_args(_args(a, scratch)))
    try:
        trainer.train()
    finally:
        trainer.close()
    dims = trainer.parallel_dims
    rows = BATCH * dims.world_size // (dims.tp * dims.pp * dims.cp)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if dist.is_initialized():
        dist.destroy_process_group()
    return trainer.ends, rows, rank


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--toml", type=Path, required=True, help="its torchtitan/models/llama3/train_configs/"
                    "debug_model.toml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1, help="pipeline degree (the TOML's Interleaved1F1B)")
    ap.add_argument("--dp-replicate", type=int, default=1)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--ac", action="store_true", help="full activation checkpointing")
    ap.add_argument("--vocab", type=int, choices=[2048, 4096], default=4096)
    ap.add_argument("--tokenizer", type=Path, default=REPO / "assets/tokenizer")
    ap.add_argument("--corpus", type=Path, default=REPO / "assets/data/shakespeare/train.jsonl.gz")
    a = ap.parse_args()
    train_and_report(lambda scratch: _train(a, scratch), a.warmup)

if __name__ == "__main__":
    main()
