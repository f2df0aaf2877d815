"""The start-up summary: what a run is about to do, in the few lines a person reads before step 1."""

from dataclasses import dataclass
from pathlib import Path

from components.config.sections import JobConfig
from components.observability.peak_flops import PeakFlops


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
    mtp_depth: int = 0  # multi-token prediction modules
    dump: Path | None = None  # where this process's records go (a replica group's own folder)


def startup_summary(cfg: JobConfig, run: RunFacts) -> str:
    """Model, layout, batch, data, numerics, the MFU peak and where the outputs go."""
    t = cfg.training
    nodes = f" on {run.nodes} nodes × {run.world_size // run.nodes} processes" if run.nodes > 1 else ""
    dump = run.dump if run.dump is not None else Path(cfg.job.dump_folder)
    return "\n".join([
        f"Kiln · {cfg.model.name}/{cfg.model.flavor} · {run.num_params / 1e6:,.2f}M parameters "
        f"({(run.num_params - run.embedding_params) / 1e6:,.2f}M non-embedding) · "
        f"{run.flops_per_token / 1e6:,.1f} MFLOP/token"
        + (f" · multi-token prediction: {run.mtp_depth} module{'s' if run.mtp_depth > 1 else ''}, "
           f"loss weight {cfg.model.mtp_loss_weight:g}" if run.mtp_depth else ""),
        f"layout  world {run.world_size}{nodes} = {run.layout} ({run.backend}, {run.device_type})",
        f"batch   global {run.global_batch} × seq {t.seq_len} = {run.global_batch * t.seq_len:,} "
        f"tokens/step; local {t.local_batch_size} × {run.microbatches} microbatch(es) per rank",
        run.data,
        f"numbers {run.numerics}; AC "
        f"{cfg.activation_checkpoint.mode}; compile {'on' if cfg.compile.enable else 'off'}",
        f"MFU     peak {run.peak.tflops:,.3f} TFLOP/s per device ({run.peak.source})",
        *([replicas_line(cfg)] if cfg.fault_tolerance.enable else []),
        f"output  {dump / 'metrics.jsonl'}; {t.steps} steps",
    ])


def replicas_line(cfg: JobConfig) -> str:
    """Fault tolerance: which replica group this is, and what the groups do together."""
    ft = cfg.fault_tolerance
    how = ("gradients averaged over the live groups every step" if ft.semi_sync == "none" else
           f"DiLoCo: an outer step every {ft.sync_every} steps (lr {ft.outer_lr:g}, Nesterov "
           f"{ft.outer_momentum:g})")
    return (f"replicas group {ft.replica_id} of {ft.group_size} (torchft), {how}; a step commits with "
            f"{ft.min_replicas}+ live; a missing group's rows are skipped; checkpoints in "
            f"{Path(cfg.job.dump_folder) / cfg.checkpoint.folder} by the first live group")


@dataclass(frozen=True)
class RunEnd:
    """What a run did, for the lines it ends with."""

    first_step: int  # the step this process started after (0 for a new run)
    last_step: int
    total_steps: int
    tokens: int  # trained on in all sessions of the run
    session_tokens: int  # trained on by this process
    session_seconds: float
    run_seconds: float  # the run's clock, continued across resumes (metrics.jsonl `time`)
    world_size: int
    last_row: dict  # the last training row logged ({} when none)
    last_val: dict  # the last validation row ({} when none)
    peak_mem_gib: float  # of the fullest rank
    checkpoint: Path | None  # the latest checkpoint of the run, None without one
    checkpointing: bool
    dump: Path
    stopped_by: str = ""  # the signal that stopped it early, "" when it reached training.steps
    compiled_graphs: int | None = None  # graphs torch.compile produced in this process; None: compile off


def compiled_graphs() -> int:
    """How many distinct graphs torch.compile's Dynamo has produced in this process so far: a run with
    compile on that reports 0 compiled nothing (every block fell back to eager)."""
    from torch._dynamo.utils import counters  # private to torch (components/runtime/torch_private.py)

    return counters["stats"]["unique_graphs"]


def duration(seconds: float) -> str:
    """1h02m03s, 3m05s or 12.3s."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    h, rem = divmod(int(seconds + 0.5), 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def end_summary(end: RunEnd) -> str:
    """Steps, tokens, time, throughput, the final losses, peak memory, the checkpoint and the outputs."""
    e = end
    tps = e.session_tokens / max(e.session_seconds, 1e-9)
    earlier = f" (the run so far: {duration(e.run_seconds)})" if e.first_step > 0 else ""
    head = (f"stopped at step {e.last_step} of {e.total_steps} on {e.stopped_by}" if e.stopped_by else
            f"done    steps {e.first_step + 1}–{e.last_step} of {e.total_steps}")
    loss = [f"loss {e.last_row['loss']:.4f} at step {e.last_row['step']}"] if e.last_row else []
    if e.last_val:
        loss.append(f"validation loss {e.last_val['val_loss']:.4f} at step {e.last_val['step']}")
    compiled = ([f"compile on: {e.compiled_graphs} graph{'' if e.compiled_graphs == 1 else 's'} compiled"]
                if e.compiled_graphs is not None else [])
    if e.checkpoint is not None:
        saved = f"checkpoint {e.checkpoint}" + (" (run the same command to resume)" if e.stopped_by else "")
    else:
        saved = "no checkpoint" + ("" if e.checkpointing else " (checkpoint.enable is off)")
    return "\n".join([
        f"{head} in {duration(e.session_seconds)}{earlier} · {e.tokens:,} tokens in all · "
        f"{tps:,.0f} tok/s ({tps / e.world_size:,.0f} tok/s/dev)",
        f"result  {' · '.join([*loss, f'peak memory {e.peak_mem_gib:.2f} GiB (fullest rank)', *compiled])}",
        f"saved   {saved} · outputs in {e.dump} (metrics.jsonl, config.toml)",
    ])
