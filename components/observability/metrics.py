"""Console lines, metrics.jsonl, TensorBoard and W&B; tokens/s, TFLOP/s, MFU and memory per step."""

import json
import math
import platform
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from components.observability.peak_flops import PeakFlops, raise_peak
from components.observability.wandb_run import WandbOptions, start_wandb_run
from components.runtime.filesystem import require_writable


def memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * (1 if platform.system() != "Darwin" else 1 / 1024) / 2**20


def fullest_rank_memory_gib(device: torch.device) -> float:
    """memory_gib of the fullest rank (every rank must call it: a collective when distributed)."""
    peak = torch.tensor(memory_gib(device), device=device)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def last_time(path: Path) -> float:
    """The `time` of the last row of a metrics.jsonl (0 when there is none): where a resumed run's
    clock continues."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return 0.0
    for line in reversed(lines):
        try:
            return float(json.loads(line)["time"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0.0


class MetricsLogger:
    """Turns per-step numbers into a console line, a metrics.jsonl row and TensorBoard/W&B scalars.

    Throughput is measured between logged steps: tokens processed per device per second.
    Only the main rank writes; other ranks keep timing so their numbers would agree.
    """

    def __init__(self, dump_folder: Path, *, is_main: bool, device: torch.device,
                 flops_per_token: int, peak: PeakFlops, total_steps: int,
                 tensorboard_dir: Path | None = None, terminal: bool | None = None,
                 wandb: WandbOptions | None = None, replica_groups: int = 0) -> None:
        self.is_main = is_main
        self.replica_groups = replica_groups  # fault tolerance: the step line says how many were live
        # A progress bar only where a person watches; CI logs and files get plain lines.
        self.terminal = sys.stdout.isatty() if terminal is None else terminal
        self._eta_origin: tuple[int, float] | None = None
        self.device = device
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.total_steps = total_steps
        self.path = Path(dump_folder) / "metrics.jsonl"
        self.start = time.perf_counter()
        self._last_time = self.start
        self.time_offset = 0.0  # seconds the run had trained before this process (a resume)
        self.last_row: dict = {}
        self.last_val: dict = {}
        self._tokens_since = 0
        self._writer = None
        self._file = None
        self._tensorboard_dir = tensorboard_dir
        self._wandb_options, self._wandb = wandb, None
        if is_main:  # fail at start-up, not at the first logged step, if the folder is unusable
            require_writable(self.path.parent, "job.dump_folder")

    def open(self, append: bool, start_step: int = 0) -> None:
        """Start writing: append to metrics.jsonl when resuming, else start it afresh. The ETA
        counts from start_step (where a resumed run picked up)."""
        self._eta_origin = (start_step, time.perf_counter())
        if append:
            self.time_offset = last_time(self.path)
        if not self.is_main:
            return
        self._file = open(self.path, "a" if append else "w", buffering=1)
        if self._tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self._tensorboard_dir))
        if self._wandb_options is not None:
            self._wandb = start_wandb_run(self.path.parent, self._wandb_options, resumed=append)

    def count_tokens(self, tokens_per_device: int) -> None:
        """Add the tokens this device processed in a step (called every step)."""
        self._tokens_since += tokens_per_device

    def log_step(self, step: int, loss: float, grad_norm: float, lr: float, tokens: int,
                 extra: dict | None = None) -> dict:
        """Emit one training row; `tokens` is the total trained on so far (all devices); `extra`
        joins the row (MoE: moe_load and moe_imbalance per layer; multi-token prediction: mtp_loss)."""
        now = time.perf_counter()
        elapsed = max(now - self._last_time, 1e-9)
        tps = self._tokens_since / elapsed
        tflops = tps * self.flops_per_token / 1e12
        if 0 < self.peak.tflops < tflops:
            self._raise_peak(tflops)
        mfu = 100.0 * tflops / self.peak.tflops if self.peak.tflops > 0 else 0.0
        self._last_time, self._tokens_since = now, 0
        row = {
            "step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": tokens,
            "tps": round(tps, 2), "tflops": round(tflops, 5), "mfu": round(mfu, 4),
            "mem_gib": round(memory_gib(self.device), 4), "time": self.run_time(now),
            **(extra or {}),
        }
        if self.is_main:
            width = len(str(self.total_steps))
            tail = f"  mtp {row['mtp_loss']:7.4f}" if "mtp_loss" in row else ""
            if row.get("source_loss"):
                tail += "  " + " ".join(f"{name} {loss:.3f}" for name, loss in row["source_loss"].items()
                                        if loss is not None)
            if "replicas" in row:
                tail += f"  replicas {row['replicas']}/{self.replica_groups}"
            if row.get("moe_imbalance"):
                worst = max(row["moe_imbalance"].items(), key=lambda kv: kv[1])
                tail += f"  experts max/mean {worst[1]:.2f} (layer {worst[0]})"
            print(
                f"{self._progress(step)}step {step:>{width}}/{self.total_steps}  loss {loss:7.4f}  "
                f"grad {grad_norm:7.3f}  lr {lr:.2e}  {tps:9,.0f} tok/s/dev  {tflops:6.3f} TFLOP/s  "
                f"MFU {mfu:5.2f}%  mem {row['mem_gib']:.2f} GiB  eta {self.eta(step, now)}{tail}",
                flush=True,
            )
            self._write(row)
        self.last_row = row
        return row

    def run_time(self, now: float | None = None) -> float:
        """Seconds since the run began, continuing across resumes (the `time` of a row)."""
        return round(self.time_offset + (time.perf_counter() if now is None else now) - self.start, 3)

    def _raise_peak(self, tflops: float) -> None:
        """This run computed faster than the peak: raise it (and its cache), so MFU stays at most 100%."""
        old = self.peak.tflops
        self.peak = raise_peak(self.peak, tflops, persist=self.is_main)
        if self.is_main:
            print(f"MFU peak raised from {old:.3f} to {tflops:.3f} TFLOP/s: this run computed faster "
                  f"than the peak it was given", flush=True)

    def eta(self, step: int, now: float) -> str:
        """Time left at the pace since this process started training, as 1h02m, 3m05s or 12s."""
        first_step, t0 = self._eta_origin or (0, self.start)
        done = step - first_step
        if done <= 0:
            return "?"
        left = max(0.0, (now - t0) / done * (self.total_steps - step))
        h, rem = divmod(int(left + 0.5), 3600)
        m, sec = divmod(rem, 60)
        return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"

    def _progress(self, step: int) -> str:
        """`[######------] 52% ` before the line on a terminal, nothing otherwise."""
        if not self.terminal:
            return ""
        width = 20
        filled = int(width * step / max(self.total_steps, 1))
        return f"[{'#' * filled}{'-' * (width - filled)}] {100 * step // max(self.total_steps, 1):3d}% "

    def log_validation(self, step: int, val_loss: float, val_tokens: int,
                       per_source: dict[str, float] | None = None) -> None:
        """Emit one validation row (carries val_loss and its perplexity; a mixture's loss of each
        source that has a validation split in val_source_loss)."""
        if self.is_main:
            ppl = math.exp(min(val_loss, 700.0))
            sources = "".join(f"  {name} {loss:.4f}" for name, loss in (per_source or {}).items())
            print(f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}  "
                  f"validation loss {val_loss:.4f}  perplexity {ppl:,.2f}  over {val_tokens:,} tokens"
                  f"{sources}", flush=True)
            row = {"step": step, "val_loss": val_loss, "val_perplexity": ppl, "val_tokens": val_tokens,
                   "time": self.run_time()}
            if per_source:
                row["val_source_loss"] = per_source
            self._write(row)
        self.last_val = {"step": step, "val_loss": val_loss}

    def _write(self, row: dict) -> None:
        self._file.write(json.dumps(row) + "\n")
        values = scalars(row)
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(key, value, row["step"])
        if self._wandb is not None:
            self._wandb.log(values, step=row["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            if self._writer is not None:
                self._writer.close()
            if self._wandb is not None:
                self._wandb.finish()


def scalars(row: dict) -> dict[str, float]:
    """The scalars of a metrics row, as TensorBoard and W&B get them: every number but the step, the
    MoE imbalance per layer, and a mixture's loss and tokens per source."""
    out = {key: value for key, value in row.items()
           if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
    for layer, ratio in row.get("moe_imbalance", {}).items():
        out[f"moe_imbalance/layer_{layer}"] = ratio
    for name, loss in row.get("source_loss", {}).items():
        if loss is not None:
            out[f"source_loss/{name}"] = loss
    for name, count in row.get("source_tokens", {}).items():
        out[f"source_tokens/{name}"] = count
    for name, loss in row.get("val_source_loss", {}).items():
        out[f"val_source_loss/{name}"] = loss
    return out
