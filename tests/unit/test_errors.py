"""Bad paths are refused before anything starts, each with one message naming the option and the
path (components/runtime/filesystem.check_paths). How the trainer ends on bad input, one clear line
and no traceback, is tests/e2e/test_errors_runs.py."""

import tempfile
from pathlib import Path

import pytest

from components.config.loading import load_config
from components.runtime.errors import KilnError
from components.runtime.filesystem import check_paths


def _bad_paths(tmp: Path) -> dict[str, tuple[list[str], list[str]]]:
    """Each bad path option: (overrides, fragments of its one-line error)."""
    a_file = tmp / "a_file"
    a_file.write_text("not a folder")
    empty = tmp / "empty"
    empty.mkdir()
    dcp_flag = ["--checkpoint.initial_load_path", str(empty)]
    return {
        "dump_folder_is_a_file": (["--job.dump_folder", str(a_file)],
                                  ["job.dump_folder", str(a_file), "a file"]),
        "dump_folder_under_a_file": (["--job.dump_folder", str(a_file / "run")],
                                     ["job.dump_folder", "a file"]),
        "data_cache_is_a_file": (["--training.data_cache_dir", str(a_file)],
                                 ["training.data_cache_dir", str(a_file)]),
        "checkpoint_folder_is_a_file": (["--checkpoint.enable", "--job.dump_folder", str(tmp),
                                         "--checkpoint.folder", "a_file"],
                                        ["checkpoint.folder", str(a_file)]),
        "tokenizer_missing": (["--model.tokenizer_path", str(tmp / "nope.json")],
                              ["model.tokenizer_path", "nope.json", "does not exist"]),
        "tokenizer_folder_empty": (["--model.tokenizer_path", str(empty)],
                                   ["model.tokenizer_path", "tokenizer.json"]),
        "initial_load_missing": (["--checkpoint.initial_load_path", str(tmp / "gone")],
                                 ["checkpoint.initial_load_path", "gone", "does not exist"]),
        "initial_load_not_dcp": (dcp_flag, ["checkpoint.initial_load_path", str(empty), ".metadata"]),
        "hf_folder_without_config": ([*dcp_flag, "--checkpoint.initial_load_in_hf"],
                                     ["checkpoint.initial_load_path", str(empty), "config.json"]),
    }


@pytest.mark.parametrize("case", list(_bad_paths(Path(tempfile.mkdtemp()))))
def test_bad_path_names_option_and_path(case, tmp_path):
    args, fragments = _bad_paths(tmp_path)[case]
    with pytest.raises(KilnError) as e:
        check_paths(load_config(["--config", "llama_debug", "--job.dump_folder", str(tmp_path / "out"),
                                 *args]))
    for fragment in fragments:
        assert fragment in str(e.value), (fragment, str(e.value))
