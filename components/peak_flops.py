"""The peak FLOP/s that MFU divides by: a table of known GPUs, or a measured (and cached) CPU peak."""

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Dense bf16 tensor-core peaks (TFLOP/s) from the vendors' data sheets, without sparsity.
GPU_PEAK_TFLOPS = {
    "H200": 989.0, "H100 SXM": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.0,
    "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 125.0, "A10": 125.0,
    "RTX 4090": 165.0, "RTX 3090": 71.0, "V100": 125.0, "MI300X": 1307.0, "MI250X": 383.0,
}


@dataclass
class PeakFlops:
    """A peak in TFLOP/s and where it came from (shown in the start-up summary)."""

    tflops: float
    source: str


def _cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "kiln" / "cpu_peak.json"


def measure_cpu_tflops(size: int = 1024, repeats: int = 8) -> float:
    """fp32 matmul rate of this process's CPU threads, best of `repeats` (TFLOP/s)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm up the BLAS threads
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e12


def cpu_peak() -> PeakFlops:
    """The measured CPU peak, cached per (processor, thread count, torch version)."""
    cpu = platform.processor() or platform.machine()
    key = f"{cpu}|threads={torch.get_num_threads()}|{torch.__version__}"
    path = _cache_file()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        cache[key] = measure_cpu_tflops()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(cache, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # an unwritable cache only costs a re-measurement next time
        source = "measured fp32 matmul on this CPU"
    else:
        source = f"measured fp32 matmul on this CPU, cached in {path}"
    return PeakFlops(cache[key], source)


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
