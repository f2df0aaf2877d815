"""Generation as a user runs it: scripts/generate.py streams seeded text from a checkpoint written by
a real run, and names a missing one. The KV cache and sampling are tests/unit/test_generate.py."""

import pytest

from tests.helpers.runs import TINY, check_ok, dump_args, fails_with, run_train


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_cache):
    """A 2-process FSDP run of the tiny model with its final checkpoint."""
    dump = tmp_path_factory.mktemp("gen")
    check_ok(run_train([*TINY, "--training.steps", "4", "--training.local_batch_size", "4",
                        "--training.global_batch_size", "8", "--checkpoint.enable",
                        "--checkpoint.interval", "4", *dump_args(dump, data_cache)], nproc=2))
    return dump / "checkpoint" / "step-4"


def test_generate_script_streams_seeded_text(trained):
    args = ["--config", "llama_debug", "--model.flavor", "tiny", "--checkpoint", str(trained),
            "--prompt", "ROMEO:", "--max-new-tokens", "25"]
    runs = [run_train([*args, "--seed", seed], script="scripts/generate.py") for seed in ("1", "1", "2")]
    for proc in runs:
        check_ok(proc)
    texts = [p.stdout for p in runs]
    assert all(t.startswith("ROMEO:") and len(t.strip()) > len("ROMEO:") for t in texts)
    assert texts[0] == texts[1] and texts[0] != texts[2]


def test_generate_script_names_a_missing_checkpoint(tmp_path):
    proc = run_train(["--config", "llama_debug", "--checkpoint", str(tmp_path / "step-9"), "--prompt", "x"],
                     script="scripts/generate.py")
    fails_with(proc, "step-9", "not a complete DCP checkpoint")
