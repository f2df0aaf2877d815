"""The tour's last stop: every train.py layout it names runs and reproduces its one-process losses."""

import json
import re
import subprocess
import sys

from tests.helpers.runs import REPO, check_ok

TOUR = REPO / "scripts" / "tutorial" / "kiln_tour.py"


def test_tour_names_real_code_and_commands():
    proc = subprocess.run([sys.executable, str(TOUR), "--dry-run"], cwd=REPO, capture_output=True, text=True)
    check_ok(proc)
    stops = re.findall(r"^== (\w+):", proc.stdout, flags=re.M)
    assert stops == ["single", "ddp2", "fsdp2", "tp2", "pp2", "cp2", "fsdp2_tp2", "moe_single", "ep2"]
    for line in re.findall(r"^   code: (.*)$", proc.stdout, flags=re.M):
        for path in re.findall(r"[\w/]+\.py", line):
            assert (REPO / path).is_file(), (line, path)
    commands = re.findall(r"^   ((?:python|torchrun) .*)$", proc.stdout, flags=re.M)
    assert len(commands) == len(stops) and all("train.py --config llama_debug" in c for c in commands)


def test_tour_layouts_match_one_process(tmp_path):
    proc = subprocess.run([sys.executable, str(TOUR), "--steps", "3", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    check_ok(proc)
    checks = re.findall(r"check: same losses as (\w+) \(max relative diff ([\d.e+-]+)\)", proc.stdout)
    assert len(checks) == 7, proc.stdout  # every stop but the two references
    assert all(float(diff) <= 1e-4 for _, diff in checks)
    # The tour's own check, redone from the dump folders it left.
    def losses(name: str) -> list[float]:
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if "loss" in r]

    def same(a: list[float], b: list[float]) -> bool:
        return len(a) == len(b) == 3 and all(abs(x - y) <= 1e-4 * abs(y) for x, y in zip(a, b, strict=True))

    for name in ("ddp2", "fsdp2", "tp2", "pp2", "cp2", "fsdp2_tp2"):
        assert same(losses(name), losses("single")), name
    assert same(losses("ep2"), losses("moe_single"))
