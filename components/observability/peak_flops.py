"""The peak FLOP/s that MFU divides by: a table of known GPUs, or a measured (and cached) CPU peak.

The CPU peak is timed by the CPU time this process spends, not by the wall clock: a machine busy
with other work slows the wall clock of a measurement but not the rate at which a core multiplies
while it runs, so a busy machine cannot make the peak low (and MFU high). A run that computes
faster than its peak raises the peak (and the cache), so MFU never exceeds 100%.
"""

import json
import os
import platform
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import torch

# Dense bf16 tensor-core peaks (TFLOP/s) from the vendors' data sheets, without sparsity.
GPU_PEAK_TFLOPS = {
    "H200": 989.0, "H100 SXM": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.0,
    "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 125.0, "A10": 125.0,
    "RTX 4090": 165.0, "RTX 3090": 71.0, "V100": 125.0, "MI300X": 1307.0, "MI250X": 383.0,
}


METHOD = ("fp32 matmul 1024², best of 3 bursts × 3 timed by this process's CPU time; "
          "threads × the one-thread rate or the all-threads rate, whichever is higher")


CACHE_VERSION = 2


MEASURED = "fp32 matmul on this CPU measured by CPU time"


@dataclass(frozen=True)
class PeakFlops:
    """A peak in TFLOP/s, where it came from (shown in the start-up summary), and the CPU cache entry
    it is stored under ("" when it is not a cached measurement)."""

    tflops: float
    source: str
    cache_key: str = ""


def cache_file() -> Path:
    """$XDG_CACHE_HOME/kiln/cpu_peak.json (~/.cache when XDG_CACHE_HOME is unset)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "kiln" / "cpu_peak.json"


def _best_rate(a: torch.Tensor, b: torch.Tensor, threads: int, bursts: int, repeats: int) -> float:
    """Best TFLOP/s of a @ b on `threads` threads, each matmul timed by CPU time per thread; the
    bursts are spread out so that one moment of memory-bandwidth contention does not decide all."""
    torch.set_num_threads(threads)
    a @ b  # warm up the BLAS threads at this count
    best = float("inf")
    for _ in range(bursts):
        for _ in range(repeats):
            start = time.process_time()
            a @ b
            best = min(best, (time.process_time() - start) / threads)
        time.sleep(0.02)
    return 2 * a.shape[0] ** 3 / max(best, 1e-9) / 1e12


def measure_cpu_tflops(size: int = 1024, bursts: int = 3, repeats: int = 3) -> dict:
    """The fp32 matmul peak of this process's CPU threads (TFLOP/s) and how it was measured."""
    threads = torch.get_num_threads()
    a, b = torch.randn(size, size), torch.randn(size, size)
    try:
        one = _best_rate(a, b, 1, bursts, repeats)
        every = _best_rate(a, b, threads, bursts, repeats) if threads > 1 else one
    finally:
        torch.set_num_threads(threads)
    return {"tflops": max(threads * one, every), "one_thread_tflops": one, "threads": threads,
            "method": METHOD, "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _read_cache(path: Path) -> dict:
    """{key: entry} from the cache; version 1 (a bare number per key, timed by the wall clock and so
    lowered by a busy machine) has no entries worth keeping, and a damaged file counts as empty."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    return {k: v for k, v in data.get("entries", {}).items() if isinstance(v, dict) and "tflops" in v}


def _write_cache(path: Path, entries: dict) -> None:
    """Replace the cache file atomically; an unwritable cache only costs a re-measurement."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass


def cpu_cache_key() -> str:
    """Processor, thread count and torch version: what the measured peak depends on."""
    cpu = platform.processor() or platform.machine()
    return f"{cpu}|threads={torch.get_num_threads()}|{torch.__version__}"


def cpu_peak() -> PeakFlops:
    """The measured CPU peak, cached per (processor, thread count, torch version) with how and when."""
    key, path = cpu_cache_key(), cache_file()
    entries = _read_cache(path)
    if key in entries:
        entry = entries[key]
        return PeakFlops(entry["tflops"], f"{entry.get('how', MEASURED)} on {entry.get('measured_at', '?')}, "
                                          f"cached in {path}", key)
    entry = {**measure_cpu_tflops(), "how": MEASURED}
    entries[key] = entry
    _write_cache(path, entries)
    return PeakFlops(entry["tflops"], f"{MEASURED} now, cached in {path}", key)


def raise_peak(peak: PeakFlops, achieved_tflops: float, persist: bool = True) -> PeakFlops:
    """The peak a run beat, raised to what it achieved (a peak below an achieved rate is wrong by
    definition); a cached CPU peak is raised in the cache too (when persist)."""
    raised = replace(peak, tflops=achieved_tflops, source=f"raised to this run's achieved rate from "
                                                          f"{peak.tflops:.3f} ({peak.source})")
    if peak.cache_key and persist:
        path = cache_file()
        entries = _read_cache(path)
        entries[peak.cache_key] = {**entries.get(peak.cache_key, {}), "tflops": achieved_tflops,
                                   "how": "raised to a run's achieved rate",
                                   "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        _write_cache(path, entries)
    return raised


def peak_flops(device: torch.device, override_tflops: float = 0.0) -> PeakFlops:
    """metrics.peak_tflops if set, else the GPU table, else the measured CPU peak."""
    if override_tflops > 0:
        return PeakFlops(override_tflops, "metrics.peak_tflops")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_TFLOPS.items():
            if key in name:
                return PeakFlops(value, f"bf16 data-sheet peak of {name}")
        return PeakFlops(0.0, f"unknown GPU {name!r}: set metrics.peak_tflops for MFU")
    return cpu_peak()
