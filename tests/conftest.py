"""The suite's environment and shared fixtures. The helpers the tests import live in tests/helpers/runs.py.

pytest imports this file before any test module, so the environment below is in place before any
test runs, and before tests/helpers/runs.py starts its warm launcher (which inherits it).
"""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# The suite never reads or writes the user's home folder: HOME itself, Kiln's CPU-peak cache, the
# Hugging Face, torch, triton and matplotlib caches go to a folder of this session (every test and
# subprocess inherits these), whatever the user's environment points them at.
ISOLATED = Path(tempfile.mkdtemp(prefix="kiln-tests-home-"))
atexit.register(shutil.rmtree, ISOLATED, ignore_errors=True)
ISOLATED_VARS = {"HOME": "home", "XDG_CACHE_HOME": "cache", "XDG_CONFIG_HOME": "config",
                 "MPLCONFIGDIR": "mpl", "HF_HOME": "cache/huggingface", "TORCH_HOME": "cache/torch",
                 "TRITON_CACHE_DIR": "cache/triton"}
for _var, _sub in ISOLATED_VARS.items():
    os.environ[_var] = str(ISOLATED / _sub)
for _var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE",
             "HF_ASSETS_CACHE", "HF_TOKEN_PATH"):  # finer overrides would escape HF_HOME
    os.environ.pop(_var, None)

# Imported here, after the environment above: the warm launcher's server inherits the environment
# as it is when tests/helpers/runs.py is first imported.
import tests.helpers.runs  # noqa: E402, F401


@pytest.fixture(scope="session")
def isolated_home() -> Path:
    """The folder of this session that stands in for the user's home and caches."""
    return ISOLATED


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One tokenized copy of the corpus shared by every end-to-end run of the session."""
    return tmp_path_factory.mktemp("data_cache")
