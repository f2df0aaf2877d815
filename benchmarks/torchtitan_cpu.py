"""TorchTitan 0.3.0 itself on CPU, for the speed table of benchmarks/benchmark_speed.py.

Trains TorchTitan's own llama3 `debugmodel` (dim 256, 6 layers, 16 heads, SwiGLU hidden 768 =
compute_ffn_hidden_dim(256, multiple_of=256), as Kiln's debug flavor) with vocab 4096 (Kiln's
tokenizer) through TorchTitan's own Trainer: its data loader, chunked loss, fused AdamW (lr 8e-4,
betas 0.9/0.95, wd 0.1), grad clip 1.0, and FSDP2 over the data-parallel ranks (applied even on one
process, as TorchTitan does). fp32 (mixed_precision_param too), seq 128, local batch 4, no
checkpointing, no validation, no AC unless --ac. Data: Kiln's embedded Shakespeare corpus,
registered as a TorchTitan dataset; tokenizer: Kiln's assets/tokenizer. Run only where torchtitan
is importable (its own virtualenv); nothing here imports Kiln. The caller sets OMP_NUM_THREADS=1.

    python benchmarks/torchtitan_cpu.py [--steps 30 --warmup 5] [--compile] [--ac]
    torchrun --standalone --nproc-per-node 2 benchmarks/torchtitan_cpu.py [--tp 2 | --pp 2]  (else FSDP 2)
    torchrun --standalone --nproc-per-node 4 benchmarks/torchtitan_cpu.py --tp 2 | --dp-replicate 2
        (FSDP 2 × TP 2 | HSDP)

Prints one JSON line on rank 0, the last line of stdout (TorchTitan's log goes to stderr):
{"tps": global tokens/s of the median step after --warmup, "peak_rss_mib": peak RSS of rank 0}.

Timing: a Trainer subclass records time.perf_counter() after each train_step; a step's time is
the gap between consecutive ends, so it covers everything train() does per step (data, forward,
backward, clip, optimizer, TorchTitan's own per-step metrics), as Kiln's and the reference's
figures do. TorchTitan's logged tps is not used: it is per device (divided by the TP/PP size), is
averaged over a log window and reaches us only as formatted log text.

Two settings differ from TorchTitan's defaults, each because the default cannot run here:
- attention: TorchTitan's language models use FlexAttention, which torch 2.13 cannot differentiate
  on CPU ("FlexAttention does not support backward on CPU"); each block's inner attention is
  TorchTitan's ScaledDotProductAttention instead (causal SDPA, what Kiln and the reference use).
- spmd_backend "partial_dtensor" (DTensor for TP only, FSDP2 on its mesh): the default
  "spmd_types" needs a newer torch's fully_shard for FSDP 2 ("When dp_mesh_dims is provided, all
  parameters must be DTensors on the full SPMD mesh").

Patches, all applied here at run time (site-packages untouched):
- device type: torchtitan.tools.utils sets device_type = "cuda" when no accelerator is found, and
  other modules copy it at import; it is set to "cpu" before those load. The process group backend
  then follows as gloo (torch's default for cpu). The device module is torch.cpu except that
  current_device() returns 0: TorchTitan calls barrier(device_ids=[current_device()]) after step 1,
  and torch.cpu's answer, the string "cpu", is refused there.
- FSDP reduction: TorchTitan sets the gradient divide factor to 1, which FSDP sends as
  ReduceOp.PREMUL_SUM(1.0) ("Cannot use ReduceOp.PREMUL_SUM with Gloo"); force-sum reduction is
  set as well (a plain SUM: the same numbers).
- memory monitor: TorchTitan's DeviceMemoryMonitor calls CUDA-only torch.cpu functions
  (get_device_name, memory_stats, ...); it is replaced by one that reports peak RSS.
- set_timeout: after step 1 TorchTitan calls torch.distributed.set_timeout, which torch 2.13 lacks
  (TorchTitan 0.3.0 follows torch nightly); where missing it is torch's _set_pg_timeout, which
  sets a group's timeout the same way.
- pipeline step: TorchTitan 0.3.0 hands the schedule ready-made microbatches (step(arg_mbs=...,
  kwarg_mbs=..., target_mbs=...)); torch 2.13's step takes the whole batch and splits it ("Expecting
  4 arg_mbs but got 1"), so the trainer's schedule gets a step that concatenates the microbatches,
  which torch splits back into the same ones.
"""

import argparse
import gzip
import inspect
import json
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SEQ, BATCH = 128, 4  # the comparison's shape


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CpuModule:
    """torch.cpu, but current_device() is an index, as barrier(device_ids=...) needs."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0


def _patch_for_cpu(fsdp_alone: bool) -> None:
    """Make TorchTitan run on CPU/gloo; must run before any other torchtitan import. Without
    fsdp_alone, no FSDP over a data-parallel mesh of one rank (TorchTitan 0.3.0 applies it)."""
    import torch
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type, tt_utils.device_module = "cpu", CpuModule()

    import torchtitan.components.metrics as tt_metrics
    import torchtitan.distributed.fsdp as tt_fsdp

    disable_division = tt_fsdp.disable_fsdp_gradient_division

    def disable_division_sum_only(model: torch.nn.Module) -> None:
        disable_division(model)
        for module in model.modules():
            if isinstance(module, tt_fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    tt_fsdp.disable_fsdp_gradient_division = disable_division_sum_only
    if not fsdp_alone:
        import torchtitan.models.llama3.parallelize as tt_parallelize

        shard = tt_parallelize.apply_fsdp_to_decoder

        def shard_over_two_or_more(model: torch.nn.Module, dp_mesh: Any, **options: Any) -> None:
            if dp_mesh.size() > 1:
                shard(model, dp_mesh, **options)

        tt_parallelize.apply_fsdp_to_decoder = shard_over_two_or_more

    tt_metrics.build_device_memory_monitor = rss_monitor(tt_metrics)

    if not hasattr(torch.distributed, "set_timeout"):  # public in torch after 2.13
        torch.distributed.set_timeout = torch.distributed.distributed_c10d._set_pg_timeout


def rss_monitor(tt_metrics: Any) -> type:
    """TorchTitan's DeviceMemoryMonitor reporting this process's peak RSS (its own is CUDA-only)."""
    import torch

    class RssMonitor(tt_metrics.DeviceMemoryMonitor):
        def __init__(self, device: str = "cpu") -> None:
            self.device = torch.device("cpu")
            self.device_name, self.device_index = "cpu", 0
            self.device_capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            self.device_capacity_gib = self._to_gib(self.device_capacity)

        def get_peak_stats(self) -> Any:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            return tt_metrics.DeviceMemStats(self._to_gib(peak), self._to_pct(peak), self._to_gib(peak),
                                             self._to_pct(peak), 0, 0)

        def reset_peak_stats(self) -> None:
            pass

    return RssMonitor


def register_corpus(name: str, corpus: Path) -> None:
    """Kiln's Shakespeare (jsonl.gz, a "text" field) as an in-memory TorchTitan dataset."""
    from datasets import Dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    def load(path: str) -> Dataset:
        with gzip.open(path, "rt") as f:
            return Dataset.from_dict({"text": [json.loads(line)["text"] for line in f]})

    DATASETS[name] = DatasetConfig(path=str(corpus), loader=load, sample_processor=lambda s: s["text"])


def _whole_batch_step(step: Callable[..., Any]) -> Callable[..., Any]:
    """A schedule's step that takes TorchTitan 0.3.0's ready-made microbatches (arg_mbs, kwarg_mbs,
    target_mbs) on torch 2.13, whose step takes the whole batch: the microbatches are concatenated
    along the batch dimension, and step splits them back into the same microbatches."""
    from torch import cat

    def whole_batch_step(*, arg_mbs: list[tuple[Any, ...]] | None = None, kwarg_mbs: list[dict[str, Any]],
                         target_mbs: list[Any] | None = None, **options: Any) -> Any:
        args = tuple(cat(parts) for parts in zip(*arg_mbs, strict=True)) if arg_mbs else ()
        kwargs = {key: cat([kw[key] for kw in kwarg_mbs]) for key in kwarg_mbs[0]}
        target = cat(target_mbs) if target_mbs is not None else None
        return step(*args, target=target, **options, **kwargs)

    return whole_batch_step


def _config(a: argparse.Namespace, dump: str) -> Any:
    """TorchTitan's llama3 debugmodel config, set to the shape and options of the comparison."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.validate import Validator
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    cfg = llama3_debugmodel()
    model = cfg.model_spec.model
    model.vocab_size = model.tok_embeddings.num_embeddings = model.lm_head.out_features = a.vocab
    for _, _, attention, field in model.traverse(FlexAttention.Config):  # no CPU backward
        setattr(attention, field, ScaledDotProductAttention.Config())
    plain = CrossEntropyLoss.Config(global_vocab_size=a.vocab)
    cfg.loss = plain if a.loss == "ce" else ChunkedLossWrapper.Config(loss_fn=plain)
    cfg.hf_assets_path = str(a.tokenizer)
    cfg.dump_folder = dump
    cfg.dataloader = HuggingFaceTextDataLoader.Config(dataset="kiln_shakespeare")
    cfg.training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ, steps=a.steps, max_norm=1.0,
                                  dtype="float32", mixed_precision_param="float32",
                                  disable_cuda_graphs=True)
    cfg.parallelism = ParallelismConfig(tensor_parallel_degree=a.tp, pipeline_parallel_degree=a.pp,
                                        data_parallel_replicate_degree=a.dp_replicate,
                                        pipeline_parallel_schedule="Interleaved1F1B",
                                        pipeline_parallel_microbatch_size=1,
                                        spmd_backend="partial_dtensor")
    cfg.compile = CompileConfig(enable=a.compile, components=["model"])
    cfg.activation_checkpoint = FullAC.Config() if a.ac else None
    cfg.checkpoint = CheckpointManager.Config(enable=False)
    cfg.validator = Validator.Config(enable=False)
    cfg.metrics = MetricsProcessor.Config(log_freq=1, disable_color_printing=True)
    return cfg


def _train(a: argparse.Namespace, scratch: str) -> tuple[list[float], int, int]:
    """Run TorchTitan's trainer; (end time of each step, global rows per step, rank)."""
    _patch_for_cpu(a.fsdp_one_process)
    import torch.distributed as dist
    from torchtitan.tools.logging import init_logger, logger
    from torchtitan.trainer import Trainer

    class TimedTrainer(Trainer):
        """Records when each train step ends."""

        ends: list[float]

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.ends = []
            if self.parallel_dims.pp_enabled:
                step = self.pp_schedule.step
                if "arg_mbs" not in inspect.signature(step).parameters:  # torch 2.13
                    self.pp_schedule.step = _whole_batch_step(step)

        def train_step(self, data_iterator: Any) -> None:
            super().train_step(data_iterator)
            self.ends.append(time.perf_counter())

    init_logger()
    for handler in logger.handlers:
        handler.setStream(sys.stderr)  # stdout carries only the result line
    register_corpus("kiln_shakespeare", a.corpus)
    trainer = TimedTrainer(_config(a, scratch))
    try:
        trainer.train()
    finally:
        trainer.close()
    dims = trainer.parallel_dims
    rows = BATCH * dims.world_size // (dims.tp * dims.pp * dims.cp)  # every data-parallel rank's rows
    rank = dist.get_rank()
    dist.destroy_process_group()
    return trainer.ends, rows, rank


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel degree")
    ap.add_argument("--pp", type=int, default=1, help="pipeline degree (Interleaved1F1B, microbatch 1)")
    ap.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas (FSDP within each)")
    ap.add_argument("--compile", action="store_true",
                    help="TorchTitan's per-block compile (components: model; the loss stays eager)")
    ap.add_argument("--ac", action="store_true", help="full activation checkpointing")
    ap.add_argument("--loss", choices=["chunked", "ce"], default="chunked",
                    help="debugmodel's chunked loss (its default) or plain cross-entropy "
                         "(its llama3_debugmodel_ce_loss)")
    ap.add_argument("--fsdp-one-process", action=argparse.BooleanOptionalAction, default=True,
                    help="FSDP over a data-parallel mesh of one rank, as TorchTitan 0.3.0 does (--no-...: "
                         "none, as its TOML-era releases did)")
    ap.add_argument("--vocab", type=int, default=4096, help="the model's vocabulary (tokenizer's ids < it)")
    ap.add_argument("--corpus", type=Path, default=REPO / "assets/data/shakespeare/train.jsonl.gz")
    ap.add_argument("--tokenizer", type=Path, default=REPO / "assets/tokenizer")
    a = ap.parse_args()
    if a.steps <= max(a.warmup, 1):
        ap.error("--steps must exceed --warmup (and 1)")
    train_and_report(lambda scratch: _train(a, scratch), a.warmup)


def train_and_report(train: Callable[[str], tuple[list[float], int, int]], warmup: int) -> None:
    """Run train(scratch folder) → (end time of each step, global rows per step, rank) as one rank
    of a world (of one under plain `python`), and print the result line on rank 0."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)  # plain `python` is a world of one
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    scratch = tempfile.mkdtemp(prefix="torchtitan_cpu_")  # dump folder and HF cache, per process
    os.environ["HF_HOME"] = os.path.join(scratch, "hf")
    try:
        ends, rows, rank = train(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if rank == 0:
        # ends[i] is the end of step i + 1, so the gap ends[i] - ends[i - 1] is step i + 1's time
        step_times = [ends[i] - ends[i - 1] for i in range(max(warmup, 1), len(ends))]
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps({"tps": rows * SEQ / statistics.median(step_times), "peak_rss_mib": round(rss)}),
              flush=True)

if __name__ == "__main__":
    main()
