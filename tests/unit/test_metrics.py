"""The console line: an ETA always, a progress bar only on a terminal."""

import torch

from components.observability.metrics import MetricsLogger
from components.observability.peak_flops import PeakFlops


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


def test_cpu_peak_is_timed_by_cpu_time_so_a_busy_machine_cannot_lower_it(monkeypatch):
    """A wall clock running ten times slow (a machine busy with other work) leaves the peak as it is."""
    import time as clock

    from components.observability import peak_flops

    torch.manual_seed(0)
    before = peak_flops.measure_cpu_tflops(size=256, bursts=2, repeats=2)
    real = clock.perf_counter
    monkeypatch.setattr(clock, "perf_counter", lambda: 10 * real())
    busy = peak_flops.measure_cpu_tflops(size=256, bursts=2, repeats=2)
    assert busy["tflops"] > 0.5 * before["tflops"], (busy, before)
    assert busy["threads"] == torch.get_num_threads() and "CPU time" in busy["method"]


def test_cpu_peak_cache_says_how_and_when_and_reads_the_old_format(tmp_path, monkeypatch):
    """A version-1 cache (a bare number per key) is measured again; the new entry records its method
    and time, and the next lookup reads it back."""
    import json
    from datetime import datetime

    from components.observability import peak_flops

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(peak_flops, "measure_cpu_tflops", lambda: {
        "tflops": 0.25, "one_thread_tflops": 0.25, "threads": 1, "method": "stub",
        "measured_at": "2026-01-02T03:04:05+00:00"})
    path = tmp_path / "kiln" / "cpu_peak.json"
    path.parent.mkdir(parents=True)
    key = peak_flops.cpu_cache_key()
    path.write_text(json.dumps({key: 0.105}))  # version 1, measured while busy
    first = peak_flops.cpu_peak()
    assert first.tflops == 0.25 and "now" in first.source and first.cache_key == key
    saved = json.loads(path.read_text())
    assert saved["version"] == 2 and saved["entries"][key]["method"] == "stub"
    datetime.fromisoformat(saved["entries"][key]["measured_at"])
    again = peak_flops.cpu_peak()
    assert again.tflops == 0.25 and "2026-01-02T03:04:05" in again.source and str(path) in again.source
    path.write_text("{not json")
    assert peak_flops.cpu_peak().tflops == 0.25  # a damaged cache is measured again, not a crash


def test_a_run_faster_than_its_peak_raises_it_and_mfu_stays_at_most_100(tmp_path, monkeypatch, capsys):
    import json

    from components.observability import peak_flops

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    m = MetricsLogger(tmp_path, is_main=True, device=torch.device("cpu"), flops_per_token=10**12,
                      peak=PeakFlops(1e-6, "stale", cache_key="cpu|threads=1|t"), total_steps=2,
                      terminal=False)
    m.open(append=False)
    m.count_tokens(1000)
    row = m.log_step(1, 3.0, 1.0, 1e-3, 1000)
    m.close()
    assert row["tflops"] > 1e-6 and row["mfu"] == 100.0
    assert abs(m.peak.tflops - row["tflops"]) <= 1e-4 * row["tflops"]
    assert "MFU peak raised" in capsys.readouterr().out
    entry = json.loads(peak_flops.cache_file().read_text())["entries"]["cpu|threads=1|t"]
    assert entry["tflops"] == m.peak.tflops and "raised" in entry["how"]


def test_time_continues_across_a_resume(tmp_path):
    """A resumed run's clock starts where the metrics file it appends to left off."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0, "time": 41.5}\n'
                                            '{"step": 1, "val_loss": 3.1, "time": 42.0}\n')
    m = MetricsLogger(tmp_path, is_main=True, device=torch.device("cpu"), flops_per_token=1000,
                      peak=PeakFlops(1.0, "test"), total_steps=4, terminal=False)
    m.open(append=True, start_step=1)
    m.count_tokens(512)
    row = m.log_step(2, 3.0, 1.0, 1e-3, 1024)
    m.close()
    assert 42.0 <= row["time"] < 42.0 + 60
