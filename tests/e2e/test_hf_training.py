"""Training starts from a Hugging Face folder exactly as from the Kiln checkpoint it was exported from."""

import subprocess
import sys

from tests.helpers.runs import REPO, TINY, check_ok, dump_args, run_train, train_rows


def test_initial_load_in_hf_equals_kiln_checkpoint(tmp_path, data_cache):
    source = tmp_path / "source"
    check_ok(run_train([*TINY, "--training.steps", "5", "--checkpoint.enable", "--checkpoint.interval", "5",
                        *dump_args(source, data_cache)]))
    step5 = source / "checkpoint" / "step-5"
    hf = tmp_path / "hf"
    check_ok(subprocess.run([sys.executable, "scripts/convert_hf.py", "to-hf", "--config", "llama_debug",
                             "--model.flavor", "tiny", "--checkpoint", str(step5), "--out", str(hf)],
                            cwd=REPO, capture_output=True, text=True))
    starts = {"kiln": ["--checkpoint.initial_load_path", str(step5)],
              "hf": ["--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf"]}
    rows = {}
    for name, extra in starts.items():
        dump = tmp_path / name
        proc = run_train([*TINY, "--training.steps", "3", "--checkpoint.enable",
                          "--training.local_batch_size", "4", *dump_args(dump, data_cache), *extra], nproc=2)
        check_ok(proc)
        assert "started from" in proc.stdout
        rows[name] = train_rows(dump)
    for a, b in zip(rows["hf"], rows["kiln"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * b["loss"], (a, b)
    # The trained weights, not a fresh init: on the same first batch the loss is below the fresh model's.
    assert rows["hf"][0]["loss"] < train_rows(source)[0]["loss"] - 0.1
