"""The suite keeps to a home folder of its own: every cache Kiln and its libraries write resolves
inside it, also in a subprocess (where a user's stale CPU-peak cache once failed the suite)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.runs import REPO

PROBE = """
import json, os
from pathlib import Path
import matplotlib, huggingface_hub.constants as hub, datasets.config as ds, torch.hub
from components.observability.peak_flops import cache_file
print(json.dumps({"kiln": str(cache_file()), "home": str(Path.home()), "hub": hub.HF_HUB_CACHE,
                  "datasets": str(ds.HF_DATASETS_CACHE), "matplotlib": matplotlib.get_configdir(),
                  "torch": torch.hub.get_dir(), "triton": os.environ["TRITON_CACHE_DIR"]}))
"""


def test_every_cache_is_inside_the_suites_own_folder(isolated_home):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                         check=True).stdout
    paths = json.loads(out.strip().splitlines()[-1])
    assert set(paths) == {"kiln", "home", "hub", "datasets", "matplotlib", "torch", "triton"}
    for name, path in paths.items():
        assert Path(path).resolve().is_relative_to(isolated_home.resolve()), (name, path, isolated_home)
