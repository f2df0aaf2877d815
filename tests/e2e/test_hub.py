"""Hugging Face hub assets by name, offline: a Hugging Face cache laid out as huggingface_hub lays it
out (models--owner--name/refs/main → snapshots/<commit>/files) is built in the test, and
HF_HUB_OFFLINE=1 makes every lookup read it, never the network."""

import os
import subprocess
import sys

import pytest
import torch

from components.checkpoint.hf_folder import save_hf_folder
from models import build_plain_model
from tests.helpers.runs import (
    REPO,
    TINY,
    check_ok,
    dump_args,
    fails_with,
    run_train,
    run_trains_side_by_side,
    train_rows,
)

REPO_ID, COMMIT = "kiln-test/tiny-llama", "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A cache holding one model repository: the tiny Llama's HF weights, config and tokenizer."""
    cache = tmp_path_factory.mktemp("hf_cache")
    repo = cache / f"models--{REPO_ID.replace('/', '--')}"
    model, spec, args = build_plain_model("llama3", "tiny")
    model.init_weights()
    adapter = spec.state_dict_adapter(args)
    save_hf_folder(repo / "snapshots" / COMMIT, adapter.to_hf(model.state_dict()), adapter.hf_config(0, 1),
                   REPO / "assets" / "tokenizer" / "tokenizer.json", torch.float32)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


def _offline(cache) -> dict:
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache.parent / "hf_home")}


def _download(cache, *args: str, repo: str = REPO_ID) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/download_hf_assets.py", "--repo", repo, *args], cwd=REPO,
                          env={**os.environ, **_offline(cache)}, capture_output=True, text=True, timeout=120)


def test_download_assets_by_kind(hub_cache, tmp_path):
    check_ok(_download(hub_cache, "--assets", "tokenizer,config", "--out", str(tmp_path / "a")))
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["config.json", "tokenizer.json",
                                                                   "tokenizer_config.json"]
    check_ok(_download(hub_cache, "--assets", "weights", "--out", str(tmp_path / "w")))
    assert [p.name for p in (tmp_path / "w").iterdir()] == ["model.safetensors"]
    snap = hub_cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    assert (tmp_path / "w" / "model.safetensors").read_bytes() == (snap / "model.safetensors").read_bytes()


def test_download_unknown_kind_and_uncached_repo(hub_cache, tmp_path):
    fails_with(_download(hub_cache, "--assets", "vocab", "--out", str(tmp_path)),
               "unknown asset kind(s) vocab")
    fails_with(_download(hub_cache, "--out", str(tmp_path), repo="kiln-test/absent"),
               "'kiln-test/absent' is not in the Hugging Face cache", "HF_HUB_OFFLINE is set")


def test_train_takes_hub_ids_for_tokenizer_and_weights(hub_cache, tmp_path, data_cache):
    """A hub id trains exactly like the snapshot folder it resolves to, named as a path."""
    snap = hub_cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    common = [*TINY, "--training.steps", "2", "--checkpoint.initial_load_in_hf",
              "--training.data_cache_dir", str(data_cache)]
    by_id, by_path = run_trains_side_by_side([
        [*common, "--model.tokenizer_path", REPO_ID, "--checkpoint.initial_load_path", REPO_ID,
         *dump_args(tmp_path / "id")],
        [*common, "--model.tokenizer_path", str(snap), "--checkpoint.initial_load_path", str(snap),
         *dump_args(tmp_path / "path")]], extra_env=_offline(hub_cache))
    check_ok(by_id)
    check_ok(by_path)
    assert f"started from the Hugging Face weights in {snap}" in by_id.stdout
    curve = [[(r["step"], r["loss"], r["grad_norm"]) for r in train_rows(tmp_path / name)]
             for name in ("id", "path")]
    assert curve[0] == curve[1] and len(curve[0]) == 2
    fails_with(run_train([*common, "--model.tokenizer_path", "kiln-test/absent",
                          *dump_args(tmp_path / "absent")], extra_env=_offline(hub_cache)),
               "'kiln-test/absent' is not in the Hugging Face cache")
