"""scripts/report.py's wall time of a run, from a continuous clock and from an older file's clock that
restarted at each resume. The report itself, run as a user runs it, is tests/e2e/test_report_runs.py."""

from scripts.report import wall_time


def test_wall_time_of_old_and_continuous_clocks():
    continuous = [{"step": 1, "time": 10.0}, {"step": 2, "time": 20.0}, {"step": 3, "time": 30.5}]
    assert wall_time(continuous) == 30.5
    restarted = [{"step": 1, "time": 10.0}, {"step": 2, "time": 20.0}, {"step": 3, "time": 4.0},
                 {"step": 3, "val_loss": 1.0, "time": 6.0}]  # an older file: each resume from 0
    assert wall_time(restarted) == 26.0
