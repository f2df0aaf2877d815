"""W&B logging, offline (WANDB_MODE=offline: the run file is written locally, nothing is sent): the
scalars TensorBoard gets, at the same steps, and a resumed run continuing the same W&B run."""

from tests.helpers.runs import TINY, check_ok, dump_args, read_metrics, run_train
from tests.helpers.wandb_records import history, run_info


def _wandb_env(tmp_path) -> dict:
    home = tmp_path / "wandb_home"
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CACHE_DIR": str(home / "cache"),
            "WANDB_CONFIG_DIR": str(home / "config"), "WANDB_DATA_DIR": str(home / "data")}


def test_wandb_offline_logs_the_metrics_and_resumes_the_same_run(tmp_path, data_cache):
    dump = tmp_path / "run"
    args = [*TINY, "--metrics.enable_wandb", "--metrics.wandb_project", "kiln-test", "--checkpoint.enable",
            *dump_args(dump, data_cache)]
    check_ok(run_train([*args, "--training.steps", "3"], extra_env=_wandb_env(tmp_path)))
    check_ok(run_train([*args, "--training.steps", "5"], extra_env=_wandb_env(tmp_path)))  # resumes at 3
    runs = sorted((dump / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2, runs
    run_id = (dump / "wandb_run_id").read_text().strip()
    assert [run_info(r) for r in runs] == [(run_id, "kiln-test", "run")] * 2
    logged = [row for r in runs for row in history(r)]
    rows = read_metrics(dump)
    assert [row["_step"] for row in logged] == [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    for got, row in zip(logged, rows, strict=True):
        numbers = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        assert {k: v for k, v in got.items() if not k.startswith("_")} == numbers
