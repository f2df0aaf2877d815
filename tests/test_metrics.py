"""The console line: an ETA always, a progress bar only on a terminal."""

import torch

from components.metrics import MetricsLogger
from components.peak_flops import PeakFlops


def logger(tmp_path, terminal: bool) -> MetricsLogger:
    m = MetricsLogger(tmp_path, is_main=True, device=torch.device("cpu"), flops_per_token=1000,
                      peak=PeakFlops(1.0, "test"), total_steps=40, terminal=terminal)
    m.open(append=False, start_step=10)  # resumed at step 10
    return m


def test_eta_counts_from_where_the_run_started(tmp_path):
    m = logger(tmp_path, terminal=False)
    first_step, t0 = m._eta_origin
    assert first_step == 10
    assert m.eta(20, t0 + 50.0) == "1m40s"  # 10 steps in 50 s, 20 to go
    assert m.eta(39, t0 + 290.0) == "10s"
    assert m.eta(10, t0 + 1.0) == "?"
    assert m.eta(11, t0 + 4000.0) == "32h13m"


def test_progress_bar_only_on_a_terminal(tmp_path, capsys):
    for terminal in (True, False):
        m = logger(tmp_path / str(terminal), terminal)
        m.count_tokens(512)
        m.log_step(20, 3.0, 1.0, 1e-3, 512 * 20)
        m.close()
        line = capsys.readouterr().out.strip()
        if terminal:
            assert line.startswith("[##########----------]  50% step 20/40")
        else:
            assert line.startswith("step 20/40") and " eta " in line
