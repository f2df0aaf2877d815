"""The start-up summary: what a run is about to do, in the few lines a person reads before step 1."""

from dataclasses import dataclass
from pathlib import Path

from components.config import JobConfig
from components.peak_flops import PeakFlops


@dataclass(frozen=True)
class RunFacts:
    """What the trainer worked out before the first step (the config says the rest)."""

    num_params: int
    embedding_params: int
    flops_per_token: int
    layout: str  # the degrees and the layout in words (ParallelDims.describe)
    world_size: int
    nodes: int
    backend: str
    device_type: str
    global_batch: int
    microbatches: int
    data: str  # the data line
    numerics: str  # what computes in which dtype, as the layout really does it
    peak: PeakFlops


def startup_summary(cfg: JobConfig, run: RunFacts) -> str:
    """Model, layout, batch, data, numerics, the MFU peak and where the outputs go."""
    t = cfg.training
    nodes = f" on {run.nodes} nodes × {run.world_size // run.nodes} processes" if run.nodes > 1 else ""
    return "\n".join([
        f"Kiln · {cfg.model.name}/{cfg.model.flavor} · {run.num_params / 1e6:,.2f}M parameters "
        f"({(run.num_params - run.embedding_params) / 1e6:,.2f}M non-embedding) · "
        f"{run.flops_per_token / 1e6:,.1f} MFLOP/token",
        f"layout  world {run.world_size}{nodes} = {run.layout} ({run.backend}, {run.device_type})",
        f"batch   global {run.global_batch} × seq {t.seq_len} = {run.global_batch * t.seq_len:,} "
        f"tokens/step; local {t.local_batch_size} × {run.microbatches} microbatch(es) per rank",
        run.data,
        f"numbers {run.numerics}; AC "
        f"{cfg.activation_checkpoint.mode}; compile {'on' if cfg.compile.enable else 'off'}",
        f"MFU     peak {run.peak.tflops:,.3f} TFLOP/s per device ({run.peak.source})",
        f"output  {Path(cfg.job.dump_folder) / 'metrics.jsonl'}; {t.steps} steps",
    ])
