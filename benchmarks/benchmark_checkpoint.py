"""Checkpoint timings: how long a save blocks training (sync vs async) and how long a load takes.

    python benchmarks/benchmark_checkpoint.py [--nproc 2] [--flavor debug]

Each mode trains the model for 12 steps with FSDP over --nproc processes, saving every 4 steps;
the table reports the median blocking time of the saves (the console's "training blocked" figure,
which includes writing the integrity manifest), the part of it the manifest's CRC-32s take (measured
again on the saved folder), and the load time of a resumed run, with the checkpoint's size on disk.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from components.checkpoint.integrity import MANIFEST, crc32_of  # noqa: E402


def run(nproc: int, args: list[str]) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = [*(launcher if nproc > 1 else [sys.executable]), "train.py", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True).stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--flavor", default="debug")
    a = ap.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="kiln-bench-"))
    print(f"| {'mode':<8} | {'save blocks (median)':>20} | {'of it CRC-32':>12} | {'load':>8} | "
          f"{'size on disk':>12} |")
    print(f"|{'-' * 10}|{'-' * 22}|{'-' * 14}|{'-' * 10}|{'-' * 14}|")
    for mode in ("disabled", "async"):
        with tempfile.TemporaryDirectory() as dump:
            base = ["--config", "llama_debug", "--model.flavor", a.flavor, "--training.seq_len", "128",
                    "--training.local_batch_size", "4", "--metrics.log_freq", "4",
                    "--job.dump_folder", dump, "--training.data_cache_dir", str(cache),
                    "--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.async_mode", mode]
            out = run(a.nproc, [*base, "--training.steps", "11"])
            # Saves at steps 4 and 8; the last step's save (11) is always synchronous.
            blocked = [float(x) for x in re.findall(r"training blocked ([\d.]+) s", out)][:-1]
            step = Path(dump) / "checkpoint" / "step-8"
            size = sum(f.stat().st_size for f in step.rglob("*") if f.is_file())
            crc = manifest_seconds(step)
            # load_step behind a newer checkpoint is refused (it would fork the run): drop step-11.
            shutil.rmtree(Path(dump) / "checkpoint" / "step-11")
            out = run(a.nproc, [*base, "--training.steps", "12", "--checkpoint.load_step", "8"])
            load = float(re.search(r"resumed from \S+ \(([\d.]+) s\)", out).group(1))
            print(f"| {mode:<8} | {statistics.median(blocked):>18.3f} s | {crc:>10.3f} s | {load:>6.3f} s | "
                  f"{size / 2**20:>9.1f} MiB |")


def manifest_seconds(step: Path) -> float:
    """Time to checksum a saved checkpoint's files as the manifest does (the files are in the page
    cache right after a save, as they are when the manifest is written)."""
    start = time.perf_counter()
    for f in step.iterdir():
        if f.is_file() and f.name != MANIFEST:
            crc32_of(f)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
