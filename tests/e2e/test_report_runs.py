"""scripts/report.py: pictures of real runs, the parity table from metrics we control, clear errors."""

import json
import re
import subprocess
import sys

import pytest
import torch

from models import get_model_spec
from scripts.report import load_run, loss_differences
from tests.helpers.runs import REPO, TINY, check_ok, dump_args, run_train

pytest.importorskip("matplotlib")


def report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/report.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_report_of_two_real_runs(tmp_path, data_cache):
    runs = []
    for name, nproc, extra in (("single", 1, []), ("fsdp2", 2, ["--training.local_batch_size", "4"])):
        dump = tmp_path / name
        check_ok(run_train([*TINY, "--training.steps", "4", "--training.global_batch_size", "8", *extra,
                            "--validation.enable", "--validation.freq", "2", "--validation.steps", "1",
                            *dump_args(dump, data_cache)],
                           nproc=nproc))
        runs.append(str(dump))
    out = tmp_path / "report.html"
    check_ok(report(*runs, "--out", str(out)))
    page = out.read_text()
    images = re.findall(r"<img alt='([^']+)' src='data:image/png;base64,", page)
    assert images == ["Training loss", "Learning rate", "Gradient norm (before clipping)", "Throughput",
                      "Model FLOPs utilisation", "Peak memory"]
    assert len(list((tmp_path / "report").glob("*.png"))) == 6
    assert "single" in page and "fsdp2" in page and "llama3/tiny" in page
    assert "<td>dp_shard 2</td>" in page and "<td>one process</td>" in page  # from the resolved config
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        size = sum(p.numel() for p in spec.model_cls(spec.flavors["tiny"]).parameters())
    assert f"<td>{size / 1e6:,.2f}M parameters</td>" in page
    assert "Loss difference against single" in page


def _fake_run(folder, losses):
    folder.mkdir()
    rows = [{"step": i + 1, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens": 512 * (i + 1), "time": i}
            for i, loss in enumerate(losses)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_difference_table_from_controlled_metrics(tmp_path):
    _fake_run(tmp_path / "a", [4.0, 3.0, 2.0])
    _fake_run(tmp_path / "b", [4.0, 3.03, 2.0])
    _fake_run(tmp_path / "c", [4.4, 3.0])
    runs = [load_run(tmp_path / n) for n in "abc"]
    (b, n_b, diff_b, rel_b, step_b), (c, n_c, diff_c, rel_c, step_c) = loss_differences(runs)
    assert (b, n_b, step_b) == ("b", 3, 2) and diff_b == pytest.approx(0.03) and rel_b == pytest.approx(0.01)
    assert (c, n_c, step_c) == ("c", 2, 1) and diff_c == pytest.approx(0.4) and rel_c == pytest.approx(0.1)
    out = tmp_path / "r.html"
    check_ok(report(str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)))
    assert "<td>b</td><td>3</td><td>3.000e-02</td><td>1.000e-02</td><td>2</td>" in out.read_text()


def test_missing_or_empty_metrics_are_clear_errors(tmp_path):
    proc = report(str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "no metrics.jsonl" in proc.stderr and "Traceback" not in proc.stderr
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    proc = report(str(tmp_path / "empty"))
    assert proc.returncode == 2 and "no training rows" in proc.stderr


def test_a_mixture_gets_its_per_source_plot(tmp_path):
    """A run's source_loss rows (and val_source_loss) become one plot of a line per source."""
    folder = tmp_path / "mix"
    folder.mkdir()
    rows = [{"step": s, "loss": 4.0 - s / 10, "lr": 1e-3, "grad_norm": 1.0, "tokens": 512 * s, "time": s,
             "source_loss": {"web": 4.1 - s / 10, "code": 3.9 - s / 10}} for s in (1, 2, 3)]
    rows.append({"step": 3, "val_loss": 3.8, "val_source_loss": {"web": 3.9, "code": 3.7}, "time": 3})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.html"
    check_ok(report(str(folder), "--out", str(out)))
    assert "Loss per source — mix" in out.read_text()
    assert (tmp_path / "r" / "source_loss_0.png").stat().st_size > 1000
