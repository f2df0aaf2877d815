"""Benchmark tables: Kiln's overhead over a plain PyTorch loop, parallel layouts, AC memory.

    python benchmarks/benchmark.py [--steps 30] [--repeats 3] [--tables overhead,parallel,memory]

Every run trains the debug model (seq 256, global batch 8) on the embedded corpus in its own
process; runs alternate (A B A B ...) so drift on a shared machine hits both sides alike, and the
table shows the median tokens/s of the timed steps (the first `--warmup` steps are not timed).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmark_families import families_table
from benchmark_speed import speed_table

REPO = Path(__file__).resolve().parents[1]


def kiln_tps(nproc: int, threads: int, steps: int, warmup: int, cache: Path, extra: list[str]) -> float:
    """Tokens/s (all processes together) of train.py between step `warmup` and the last step."""
    with tempfile.TemporaryDirectory() as dump:
        args = ["--config", "llama_debug", "--training.steps", str(steps), "--metrics.log_freq", "1",
                "--training.global_batch_size", "8",
                "--job.dump_folder", dump, "--training.data_cache_dir", str(cache), *extra]
        if nproc == 1:
            cmd = [sys.executable, "train.py", *args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", "train.py", *args]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
        rows = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "loss" in r]
        first, last = rows[warmup - 1], rows[-1]
        return (last["tokens"] - first["tokens"]) / (last["time"] - first["time"])


def plain_tps(threads: int, steps: int, warmup: int, cache: Path) -> float:
    """Tokens/s of benchmarks/plain_loop.py on the same data."""
    tokens = next(cache.glob("train-*.bin"))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "benchmarks/plain_loop.py", "--tokens", str(tokens),
                          "--steps", str(steps), "--warmup", str(warmup)],
                         cwd=REPO, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["tps"]


def parallel_table(a: argparse.Namespace, cache: Path) -> None:
    """Tokens/s (all processes) of the parallel layouts, plain, with full AC and with compile."""
    layouts = {
        "FSDP 2": (2, ["--training.local_batch_size", "4"]),
        "TP 2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
        "FSDP 2 × TP 2": (4, ["--parallelism.tensor_parallel_degree", "2",
                              "--training.local_batch_size", "4"]),
    }
    options = {"plain": [], "AC full": ["--activation_checkpoint.mode", "full"],
               "compile": ["--compile.enable"]}
    print(f"\n| {'layout (1 thread per process)':<32} | " + " | ".join(f"{o:>9}" for o in options) + " |")
    print(f"|{'-' * 34}|" + "|".join("-" * 11 for _ in options) + "|")
    for name, (nproc, extra) in layouts.items():
        cells = []
        for opt in options.values():
            try:
                runs = [kiln_tps(nproc, 1, a.steps, a.warmup, cache, [*extra, *opt])
                        for _ in range(a.repeats)]
                cells.append(f"{statistics.median(runs):>9,.0f}")
            except subprocess.CalledProcessError:  # a layout this machine cannot run
                cells.append(f"{'failed':>9}")
        print(f"| {name:<32} | " + " | ".join(cells) + " |")


def bubble(schedule: str, pp: int, m: int) -> str:
    """The textbook idle fraction of a schedule with pp ranks and m microbatches."""
    if schedule in ("GPipe", "1F1B"):
        return f"{(pp - 1) / (m + pp - 1):.2f}"
    if schedule in ("Interleaved1F1B", "LoopedBFS"):  # two stages per rank
        return f"{(pp - 1) / (2 * m + pp - 1):.2f}"
    return "≈0 (ideal)"  # zero-bubble schedules fill the gap with weight-gradient work


def pipeline_table(a: argparse.Namespace, cache: Path) -> None:
    """Step time of every schedule at PP 2 (debug model, seq 256), 4 and 8 microbatches of 1 row."""
    schedules = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                 "DualPipeV"]
    print(f"\n| {'schedule (PP 2, 1 thread each)':<32} | {'m=4 step':>9} | {'bubble':>10} | "
          f"{'m=8 step':>9} | {'bubble':>10} |")
    print(f"|{'-' * 34}|{'-' * 11}|{'-' * 12}|{'-' * 11}|{'-' * 12}|")
    for name in schedules:
        cells = []
        for m in (4, 8):
            extra = ["--parallelism.pipeline_parallel_degree", "2",
                     "--parallelism.pipeline_parallel_schedule", name,
                     "--training.local_batch_size", str(m), "--training.global_batch_size", str(m)]
            tps = statistics.median(kiln_tps(2, 1, a.steps, a.warmup, cache, extra) for _ in range(a.repeats))
            cells.append(f"{m * 256 / tps:>7.3f} s | {bubble(name, 2, m):>10}")
        print(f"| {name:<32} | " + " | ".join(cells) + " |")


def memory_table(cache: Path) -> None:
    """Peak memory (RSS on CPU) of one process, debug model at seq 1024, with each AC mode."""
    modes = {"none": [], "selective (every 2nd block)": ["--activation_checkpoint.mode", "selective"],
             "selective (per op)": ["--activation_checkpoint.mode", "selective",
                                    "--activation_checkpoint.selective_ac_option", "op"],
             "full": ["--activation_checkpoint.mode", "full"]}
    print(f"\n| {'activation checkpointing':<28} | {'peak memory':>11} | {'tokens/s':>9} |")
    print(f"|{'-' * 30}|{'-' * 13}|{'-' * 11}|")
    for name, extra in modes.items():
        with tempfile.TemporaryDirectory() as dump:
            args = ["--config", "llama_debug", "--training.seq_len", "1024",
                    "--training.local_batch_size", "8", "--training.global_batch_size", "8",
                    "--training.steps", "3", "--metrics.log_freq", "1",
                    "--job.dump_folder", dump,
                    "--training.data_cache_dir", str(cache), *extra]
            subprocess.run([sys.executable, "train.py", *args], cwd=REPO, check=True, capture_output=True)
            rows = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
        print(f"| {name:<28} | {rows[-1]['mem_gib']:>7.2f} GiB | {rows[-1]['tps']:>9,.0f} |")


def cp_table(cache: Path, seq_len: int) -> None:
    """Peak memory (RSS of rank 0) and tokens/s of one long sequence at CP 1, 2, 4, per rotate method."""
    print(f"\n| {f'context parallel (seq {seq_len})':<32} | {'peak memory':>11} | {'tokens/s':>9} |")
    print(f"|{'-' * 34}|{'-' * 13}|{'-' * 11}|")
    runs = [(1, "allgather")] + [(cp, m) for cp in (2, 4) for m in ("allgather", "ring")]
    for cp, method in runs:
        with tempfile.TemporaryDirectory() as dump:
            args = ["--config", "llama_debug", "--training.seq_len", str(seq_len),
                    "--training.local_batch_size", "1", "--training.global_batch_size", "1",
                    "--training.steps", "3", "--metrics.log_freq", "1", "--job.dump_folder", dump,
                    "--training.data_cache_dir", str(cache),
                    "--parallelism.context_parallel_degree", str(cp),
                    "--parallelism.context_parallel_rotate_method", method]
            cmd = ([sys.executable, "train.py"] if cp == 1 else
                   [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}",
                    "train.py"])
            env = dict(os.environ, OMP_NUM_THREADS="1")
            subprocess.run([*cmd, *args], cwd=REPO, env=env, check=True, capture_output=True)
            rows = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
        name = "CP 1 (one process)" if cp == 1 else f"CP {cp} {method}"
        tps = rows[-1]["tps"] * cp  # tps is per device
        print(f"| {name:<32} | {rows[-1]['mem_gib']:>7.2f} GiB | {tps:>9,.0f} |")


def data_table(cache: Path, steps: int = 300) -> None:
    """Tokens/s of the data path beside what training consumes: tokenizing the corpus once, and
    the memmap loader cutting global batches (debug config: 16 × 256) step after step."""
    import time

    sys.path.insert(0, str(REPO))
    from components.data.loader import BatchLoader, TokenWindows
    from components.data.sources import EMBEDDED_DATASETS, read_documents
    from components.data.streaming import StreamingLoader
    from components.data.token_cache import write_token_file
    from components.data.tokenizer import Tokenizer

    tokenizer = Tokenizer(REPO / "assets" / "tokenizer" / "tokenizer.json")
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        total = write_token_file(read_documents(EMBEDDED_DATASETS["shakespeare"]["train"]), tokenizer,
                                 Path(tmp) / "train.bin")
        tokenize = total / (time.perf_counter() - start)
        windows = TokenWindows(Path(tmp) / "train.bin", 256, 4096)
        rows = []
        for dp in (1, 4):
            loader = BatchLoader(windows, 16, 16 // dp, 0, dp, seed=42)
            start = time.perf_counter()
            for step in range(1, steps + 1):
                loader.batch(step)
            rows.append((dp, steps * 16 // dp * 256 / (time.perf_counter() - start)))
        stream = StreamingLoader(str(EMBEDDED_DATASETS["shakespeare"]["train"]), "text", tokenizer, 256,
                                 16, 16, 0, 1, cache_dir=tmp)
        stream.batch(1)  # opening the stream is not part of the rate
        start = time.perf_counter()
        for step in range(2, steps + 2):
            stream.batch(step)
        streaming = steps * 16 * 256 / (time.perf_counter() - start)
    print(f"\n| {'data path (one process)':<48} | {'tokens/s':>12} |")
    print(f"|{'-' * 50}|{'-' * 14}|")
    print(f"| {'tokenize the corpus (BOS text EOS, batched)':<48} | {tokenize:>12,.0f} |")
    for dp, tps in rows:
        print(f"| {f'memmap loader, one rank of dp {dp} (16 × 256)':<48} | {tps:>12,.0f} |")
    print(f"| {'streaming loader (tokenize on the fly, 16 × 256)':<48} | {streaming:>12,.0f} |")


def collectives_table() -> None:
    """gloo's all-gather and reduce-scatter beside Kiln's FSDP collectives, on 2 and 4 processes."""
    for nproc in (2, 4):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "benchmarks/benchmark_collectives.py"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        print(subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True).stdout)


def tokenize_seconds(nproc: int, corpus: Path, rayon_threads: str) -> float:
    """Seconds train.py's ranks take to tokenize `corpus` the first time (its own 'tokenized' line)."""
    with tempfile.TemporaryDirectory() as dump:
        args = ["train.py", "--config", "llama_debug", "--model.flavor", "tiny", "--training.steps", "1",
                "--training.dataset_path", str(corpus), "--job.dump_folder", dump]
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd = [sys.executable, *args] if nproc == 1 else [*launch, *args]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if rayon_threads:
            env["RAYON_NUM_THREADS"] = rayon_threads
        out = subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("tokenized "))
    return float(line.rsplit(" in ", 1)[1].split()[0])


def tokenize_table() -> None:
    """Tokenizing a new corpus (Shakespeare ×3, 4.8M tokens) on 1 and 2 ranks of this machine."""
    sys.path.insert(0, str(REPO))
    from components.data.sources import EMBEDDED_DATASETS, read_documents

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "shakespeare_x3.jsonl"
        docs = list(read_documents(EMBEDDED_DATASETS["shakespeare"]["train"]))
        corpus.write_text("".join(json.dumps({"text": f"{i} {d}"}) + "\n" for i in range(3) for d in docs))
        print(f"\n| {'tokenize a new corpus (4.8M tokens)':<48} | {'1 rank':>8} | {'2 ranks':>8} |")
        print(f"|{'-' * 50}|{'-' * 10}|{'-' * 10}|")
        for name, rayon in (("the node's cores shared by its ranks (default)", ""),
                            ("one tokenizer thread per rank", "1")):
            cells = [f"{tokenize_seconds(n, corpus, rayon):>6.1f} s" for n in (1, 2)]
            print(f"| {name:<48} | " + " | ".join(cells) + " |")


def init_peak_gib(repo: Path, nproc: int, flavor: str, cache: Path) -> tuple[float, float]:
    """(peak RSS of the fullest rank in GiB, seconds) of writing a seed checkpoint of `flavor` on
    nproc ranks with the train.py of `repo`: initialisation plus a model-only save, no step. Each
    rank runs under /usr/bin/time; a tree whose train.py refuses a multi-rank seed checkpoint still
    initialises first, so its peak is measured all the same."""
    import time

    with tempfile.TemporaryDirectory() as dump:
        args = ["train.py", "--config", "llama_debug", "--model.flavor", flavor, "--training.steps", "1",
                "--checkpoint.create_seed_checkpoint", "--job.dump_folder", dump,
                "--training.data_cache_dir", str(cache)]
        timed = ["/usr/bin/time", "-f", "kiln-peak-rss-kib %M", sys.executable, *args]
        cmd = timed if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                        f"--nproc-per-node={nproc}", "--no-python", *timed]
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)))
        start = time.perf_counter()
        out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    peaks = [int(line.split()[-1]) for line in (out.stdout + out.stderr).splitlines()
             if line.startswith("kiln-peak-rss-kib")]
    return (max(peaks) / 2**20 if peaks else float("nan")), seconds


def init_table(a: argparse.Namespace, cache: Path) -> None:
    """Peak memory per rank of initialising real-size flavors (a seed checkpoint, no step), this tree
    against --baseline (another checkout, e.g. `git worktree add /tmp/old <commit>`)."""
    runs = [("1B", n) for n in (1, 2, 4)] + [("3B", 4)]
    trees = {"this tree": REPO, **({"baseline": Path(a.baseline)} if a.baseline else {})}
    print(f"\n| {'init, peak RSS of the fullest rank':<36} | " + " | ".join(f"{t:>18}" for t in trees) + " |")
    print(f"|{'-' * 38}|" + "|".join("-" * 20 for _ in trees) + "|")
    for flavor, nproc in runs:
        cells = []
        for name, tree in trees.items():
            if name == "baseline" and (flavor not in a.baseline_flavors.split(",")
                                       or nproc > a.baseline_max_ranks):
                cells.append(f"{'not run':>18}")
                continue
            gib, seconds = init_peak_gib(tree, nproc, flavor, cache)
            cells.append(f"{gib:>6.2f} GiB {seconds:>5.0f} s")
        print(f"| {f'{flavor}, {nproc} rank(s), FSDP':<36} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads of a single-process run (FSDP runs use threads / nproc each)")
    ap.add_argument("--tables", default="overhead",
                    help="comma-separated: speed (Kiln vs TorchTitan and an independent reference loop per "
                         "layout), collectives (gloo's all-gather and reduce-scatter vs Kiln's), "
                         "overhead (Kiln vs plain loop, FSDP 2 vs 1), parallel "
                         "(FSDP/TP layouts × AC/compile), memory (peak memory per AC mode), pipeline "
                         "(step time per schedule), cp (peak memory of a long sequence per CP degree), "
                         "data (tokenizer and loader tokens/s), init (peak memory of initialising "
                         "the 1B and 3B flavors on 1-4 ranks), tokenize (a new corpus on 1 and 2 ranks), "
                         "families (each family's debug model beside a Llama of its parameter count)")
    ap.add_argument("--torchtitan-python", default="",
                    help="speed table: a Python interpreter where torchtitan is installed (adds its column)")
    ap.add_argument("--speed-layouts", default="",
                    help="speed table: only these layouts, names separated by ';' (default: all)")
    ap.add_argument("--cp-seq-len", type=int, default=8192, help="sequence length of the cp table")
    ap.add_argument("--baseline", default="", help="init table: another checkout to measure beside this one")
    ap.add_argument("--baseline-flavors", default="1B",
                    help="init table: flavors the baseline runs (a full copy per rank may not fit)")
    ap.add_argument("--baseline-max-ranks", type=int, default=2,
                    help="init table: the most ranks the baseline runs (each may hold the whole model)")
    a = ap.parse_args()
    tables = set(a.tables.split(","))
    cache = Path(tempfile.mkdtemp(prefix="kiln-bench-"))
    try:
        kiln_tps(1, 1, 2, 1, cache, [])  # tokenize the corpus once, outside the timings
        run_tables(a, tables, cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def run_tables(a: argparse.Namespace, tables: set[str], cache: Path) -> None:
    """Print each table asked for, in a fixed order, on the one tokenized corpus."""
    if "speed" in tables:
        layouts = [n.strip() for n in a.speed_layouts.split(";") if n.strip()]
        speed_table(a.steps, a.warmup, a.repeats, cache, a.torchtitan_python, layouts)
    if "collectives" in tables:
        collectives_table()
    if "overhead" in tables:
        overhead_table(a, cache)
    if "parallel" in tables:
        parallel_table(a, cache)
    if "cp" in tables:
        cp_table(cache, a.cp_seq_len)
    if "data" in tables:
        data_table(cache)
    if "memory" in tables:
        memory_table(cache)
    if "pipeline" in tables:
        pipeline_table(a, cache)
    if "init" in tables:
        init_table(a, cache)
    if "tokenize" in tables:
        tokenize_table()
    if "families" in tables:
        families_table(a.steps, a.warmup, a.repeats,
                       lambda extra: kiln_tps(1, a.threads, a.steps, a.warmup, cache, extra))


def overhead_table(a: argparse.Namespace, cache: Path) -> None:
    """Kiln's single-process step against the plain loop, and FSDP 2 against one process."""
    runs = {
        f"plain PyTorch loop, 1 process × {a.threads} threads":
            lambda: plain_tps(a.threads, a.steps, a.warmup, cache),
        f"Kiln, 1 process × {a.threads} threads":
            lambda: kiln_tps(1, a.threads, a.steps, a.warmup, cache, []),
        "Kiln, 1 process × 1 thread": lambda: kiln_tps(1, 1, a.steps, a.warmup, cache, []),
        "Kiln FSDP2, 2 processes × 1 thread": lambda: kiln_tps(
            2, 1, a.steps, a.warmup, cache, ["--training.local_batch_size", "4",
                                             "--training.global_batch_size", "8"]),
    }
    results: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(a.repeats):
        for name, fn in runs.items():
            results[name].append(fn())
    median = {name: statistics.median(v) for name, v in results.items()}
    names = list(runs)
    base = median[names[0]]
    print(f"\ndebug model (7.2M params), seq 256, global batch 8, {a.steps} steps ({a.warmup} untimed), "
          f"median of {a.repeats}\n")
    print(f"| {'run':<44} | {'tokens/s':>9} | {'vs plain loop':>13} |")
    print(f"|{'-' * 46}|{'-' * 11}|{'-' * 15}|")
    for name in names:
        print(f"| {name:<44} | {median[name]:>9,.0f} | {median[name] / base:>13.3f} |")
    one = median["Kiln, 1 process × 1 thread"]
    fsdp = median["Kiln FSDP2, 2 processes × 1 thread"]
    print(f"\nKiln overhead: Kiln / plain = {median[names[1]] / base:.3f}; "
          f"FSDP2 (2 × 1 thread) / 1 process × 1 thread = {fsdp / one:.2f}")


if __name__ == "__main__":
    main()
