"""What separates two Kiln-beside-TorchTitan comparisons: Kiln / TorchTitan measured setting by
setting, one difference at a time, on the same machine in one session.

The speed table (benchmarks/benchmark_speed.py) sets Kiln against TorchTitan 0.3.0 at vocabulary 4096
(Kiln's tokenizer); the other comparison runs TorchTitan's last TOML-config commit through its own
debug_model.toml at its own vocabulary of 2048. The settings, each against Kiln at the same
vocabulary and layout (Kiln with torch's own collectives):

- `0.3.0`: TorchTitan 0.3.0 as the speed table runs it (chunked loss, FSDP even on one process);
- `0.3.0 plain CE`: its plain cross-entropy instead of the chunked loss;
- `0.3.0 plain CE, no FSDP on 1`: and no FSDP over a data-parallel mesh of one rank;
- `0.3.0 vocab 2048`: the speed table's TorchTitan at vocabulary 2048;
- `TOML 2048`: TorchTitan at its TOML-era commit, its own defaults (vocabulary 2048);
- `TOML 4096`: the same at vocabulary 4096 (Kiln's tokenizer).

    python benchmarks/benchmark_torchtitan_settings.py --tt-python /tmp/tt/bin/python \\
        --toml-python /tmp/ttold/bin/python \\
        --toml /tmp/tt238/torchtitan/models/llama3/train_configs/debug_model.toml

Vocabulary 2048 means a 2048-token BPE trained on the corpus (scripts/train_tokenizer.py) for both
trainers (TorchTitan's own test tokenizer has no BOS/EOS tokens in its tokenizer.json, which Kiln
needs); what matters to the speed is the vocabulary's size, which shapes the embedding, the output
head and the loss. Each cell is the median over --repeats of the median step's global tokens/s
(Kiln and TorchTitan alternate), the shape of the speed table otherwise: dim 256, 6 layers, seq 128,
local batch 4, fp32, one thread per process. Results and their date: benchmarks/speed.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_speed import REPO, _json_result, _launch, kiln_runner  # noqa: E402

LAYOUTS = {"1 process": (1, [], []), "FSDP 2": (2, [], []),
           "TP 2": (2, ["--parallelism.tensor_parallel_degree", "2"], ["--tp", "2"]),
           "PP 2": (2, ["--parallelism.pipeline_parallel_degree", "2",
                        "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                        "--parallelism.pipeline_parallel_microbatch_size", "1"], ["--pp", "2"])}
# setting: (TorchTitan launcher, its options, vocabulary, layouts measured)
SETTINGS: dict[str, tuple[str, list[str], int, list[str]]] = {
    "0.3.0": ("0.3.0", [], 4096, list(LAYOUTS)),
    "0.3.0 plain CE": ("0.3.0", ["--loss", "ce"], 4096, ["1 process", "FSDP 2"]),
    "0.3.0 plain CE, no FSDP on 1": ("0.3.0", ["--loss", "ce", "--no-fsdp-one-process"], 4096, ["1 process"]),
    "0.3.0 vocab 2048": ("0.3.0", ["--vocab", "2048"], 2048, ["1 process", "FSDP 2"]),
    "TOML 2048": ("toml", ["--vocab", "2048"], 2048, list(LAYOUTS)),
    "TOML 4096": ("toml", ["--vocab", "4096"], 4096, list(LAYOUTS)),
}
VOCAB_2048_MODEL = '''"""The llama3 debug flavor at vocabulary 2048, registered from outside Kiln."""
import dataclasses
from models import get_model_spec, register_model_spec
spec = get_model_spec("llama3")
register_model_spec(dataclasses.replace(spec, name="llama3_vocab2048", flavors={
    "debug": dataclasses.replace(spec.flavors["debug"], vocab_size=2048)}))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tt-python", required=True, help="an interpreter with torchtitan 0.3.0")
    ap.add_argument("--toml-python", required=True, help="an interpreter with the TOML-era torchtitan")
    ap.add_argument("--toml", type=Path, required=True, help="its llama3 train_configs/debug_model.toml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--settings", default=";".join(SETTINGS), help="setting names separated by ';'")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        small_tokenizer = Path(tmp) / "tokenizer2048"
        small_tokenizer.mkdir()
        subprocess.run([sys.executable, "scripts/train_tokenizer.py", "--vocab-size", "2048", "--out",
                        str(small_tokenizer / "tokenizer.json")], cwd=REPO, check=True, capture_output=True)
        model_file = Path(tmp) / "kiln_vocab2048.py"
        model_file.write_text(VOCAB_2048_MODEL)
        kiln = {4096: kiln_runner(a.steps, a.warmup, Path(tmp) / "cache4096"),
                2048: kiln_runner(a.steps, a.warmup, Path(tmp) / "cache2048")}
        kiln_vocab = {4096: [], 2048: ["--job.custom_import", str(model_file), "--model.name",
                                       "llama3_vocab2048", "--model.tokenizer_path", str(small_tokenizer)]}
        rows = []
        for name in [n.strip() for n in a.settings.split(";")]:
            launcher, options, vocab, layouts = SETTINGS[name]
            if launcher == "0.3.0":
                tt = [a.tt_python, "benchmarks/torchtitan_cpu.py", options]
                if vocab == 2048:
                    tt[2] = [*options, "--tokenizer", str(small_tokenizer)]
            else:
                tt = [a.toml_python, "benchmarks/torchtitan_toml_cpu.py", ["--toml", str(a.toml), *options]]
                if vocab == 2048:
                    tt[2] = [*tt[2], "--tokenizer", str(small_tokenizer)]
            for layout in layouts:
                nproc, kiln_options, tt_options = LAYOUTS[layout]
                ours, theirs = [], []
                for _ in range(a.repeats):
                    ours.append(kiln[vocab](nproc, [*kiln_vocab[vocab], *kiln_options])[0])
                    args = [*tt[2], "--steps", str(a.steps), "--warmup", str(a.warmup), *tt_options]
                    theirs.append(_json_result(_launch(tt[0], nproc, tt[1], args))[0])
                rows.append((name, layout, statistics.median(ours), statistics.median(theirs)))
                print(f"| {name} | {layout} | {rows[-1][2]:,.0f} | {rows[-1][3]:,.0f} | "
                      f"{rows[-1][2] / rows[-1][3]:.2f} |", flush=True)
    print("\n| setting | layout | Kiln tok/s | TorchTitan tok/s | Kiln / TorchTitan |\n|---|---|---|---|---|")
    for name, layout, ours, theirs in rows:
        print(f"| {name} | {layout} | {ours:,.0f} | {theirs:,.0f} | {ours / theirs:.2f} |")


if __name__ == "__main__":
    main()
