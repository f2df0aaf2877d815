"""Hugging Face conversion: transformers gives Kiln's logits, round trips are exact, bad input is named.

The converter runs as a user runs it (a subprocess); the tied and rope-scaled variants of the tiny
flavor reach it through --job.custom_import of a module this file writes. The RoPE row permutation
alone is tests/unit/test_hf.py.
"""

import dataclasses
import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from components.checkpoint.hf_folder import kiln_state_from_hf, load_hf_state
from components.checkpoint.states import ModelState, SafeLoadPlanner
from components.data.tokenizer import Tokenizer
from components.runtime.errors import KilnError
from models import get_model_spec
from models.llama3.state_dict_adapter import LlamaStateDictAdapter
from tests.helpers.runs import REPO, check_ok

transformers = pytest.importorskip("transformers")  # a test-only dependency
# Saving and loading DCP in one process without a process group is what these tests mean to do.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TOKENIZER = REPO / "assets" / "tokenizer" / "tokenizer.json"
VARIANTS_SOURCE = '''
"""Registers "llama3_hf_test": the tiny Llama, plain, tied, and with the 1B flavor's RoPE scaling."""
import dataclasses
from models import get_model_spec, register_model_spec
_llama = get_model_spec("llama3")
_tiny = _llama.flavors["tiny"]
register_model_spec(dataclasses.replace(_llama, name="llama3_hf_test", flavors={
    "tiny": _tiny,
    "tied": dataclasses.replace(_tiny, tie_embeddings=True),
    "scaled": dataclasses.replace(_tiny, rope_scaling=_llama.flavors["1B"].rope_scaling),
}))
'''
VARIANTS = ["tiny", "tied", "scaled"]


@pytest.fixture(scope="module")
def variants_dir(tmp_path_factory) -> Path:
    """A folder holding the variants module, imported here too so that the test sees the same flavors."""
    folder = tmp_path_factory.mktemp("variants")
    path = folder / "kiln_hf_variants.py"
    path.write_text(VARIANTS_SOURCE)
    spec = importlib.util.spec_from_file_location("kiln_hf_variants", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    return folder


def convert(variants_dir: Path, command: str, flavor: str, *args: str) -> subprocess.CompletedProcess:
    """Run scripts/convert_hf.py as a user would, on one variant of the tiny model."""
    model = ["--config", "llama_debug", "--job.custom_import", "kiln_hf_variants",
             "--model.name", "llama3_hf_test", "--model.flavor", flavor]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(variants_dir))
    return subprocess.run([sys.executable, "scripts/convert_hf.py", command, *model, *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)


def random_model(flavor: str, seed: int = 0) -> torch.nn.Module:
    """The variant with seeded random weights, made so that each mapping mistake shows in the logits."""
    spec = get_model_spec("llama3_hf_test")
    torch.manual_seed(seed)
    model = spec.model_cls(spec.flavors[flavor])
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # not all ones: swapped norms would change nothing
                p.uniform_(0.5, 1.5)
            if name.endswith(("wq.weight", "wk.weight")):  # sharp attention: RoPE errors show ~1e3x
                p.normal_(0.0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def export(variants_dir, tmp_path_factory):
    """flavor → (Kiln model, HF folder written by to-hf from its DCP checkpoint), made once per flavor."""
    made: dict[str, tuple[torch.nn.Module, Path]] = {}

    def make(flavor: str) -> tuple[torch.nn.Module, Path]:
        if flavor not in made:
            root = tmp_path_factory.mktemp(f"hf_{flavor}")
            model = random_model(flavor)
            dcp.save({"model": ModelState([model])}, checkpoint_id=str(root / "step-3"))
            check_ok(convert(variants_dir, "to-hf", flavor, "--checkpoint", str(root / "step-3"),
                             "--out", str(root / "hf")))
            made[flavor] = model, root / "hf"
        return made[flavor]

    return make


@functools.cache
def script() -> ModuleType:
    """scripts/convert_hf.py as a module, to call its main() in this process without a start-up."""
    spec = importlib.util.spec_from_file_location("convert_hf", REPO / "scripts" / "convert_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def convert_here(flavor: str, command: str, *args: str) -> int:
    """The converter's main() on one variant (registered in this process by variants_dir)."""
    return script().main([command, "--config", "llama_debug", "--model.name", "llama3_hf_test",
                          "--model.flavor", flavor, *args])


@pytest.mark.parametrize("flavor", VARIANTS)
def test_logits_match_transformers(export, flavor):
    model, folder = export(flavor)
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.randint(0, model.args.vocab_size, (2, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert hf.config.tie_word_embeddings == model.args.tie_embeddings
    # transformers reads our config back in its own form; the adapter must accept that form too.
    LlamaStateDictAdapter(model.args).args_from_hf_config(hf.config.to_dict())
    names = set(load_file(folder / "model.safetensors"))
    assert ("lm_head.weight" in names) != model.args.tie_embeddings


def test_scaled_variant_uses_llama3_rope(export):
    _, folder = export("scaled")
    scaling = json.loads((folder / "config.json").read_text())["rope_scaling"]
    assert scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("flavor", VARIANTS)
def test_round_trip_is_bit_identical(export, flavor, tmp_path):
    """HF → Kiln DCP (from-hf) → HF (to-hf) gives the same tensors; the DCP holds the same model."""
    model, folder = export(flavor)
    assert convert_here(flavor, "from-hf", "--hf", str(folder), "--out", str(tmp_path / "step-0")) == 0
    reloaded = random_model(flavor, seed=1)
    dcp.load({"model": ModelState([reloaded])}, checkpoint_id=str(tmp_path / "step-0"),
             planner=SafeLoadPlanner())
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    assert convert_here(flavor, "to-hf", "--checkpoint", str(tmp_path / "step-0"),
                        "--out", str(tmp_path / "hf")) == 0
    before, after = load_file(folder / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), name
    assert (folder / "config.json").read_text() == (tmp_path / "hf" / "config.json").read_text()


def test_bfloat16_export_round_trips(export, tmp_path):
    _, folder = export("tiny")
    step = folder.parent / "step-3"
    assert convert_here("tiny", "to-hf", "--checkpoint", str(step), "--out", str(tmp_path / "hf"),
                        "--dtype", "bfloat16") == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert convert_here("tiny", "from-hf", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "s0")) == 0
    assert convert_here("tiny", "to-hf", "--checkpoint", str(tmp_path / "s0"), "--out", str(tmp_path / "hf2"),
                        "--dtype", "bfloat16") == 0
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert all(a[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("flavor", VARIANTS)
def test_sharded_transformers_save_loads(export, flavor, tmp_path):
    """A folder written by transformers itself (sharded, its own config form) reads back exactly."""
    model, folder = export(flavor)
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="1MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    state = kiln_state_from_hf(tmp_path, LlamaStateDictAdapter(model.args))
    assert state.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_tokenizer_encodes_like_kiln(export):
    _, folder = export("tiny")
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    ours = Tokenizer(TOKENIZER)
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (ours.bos_id, ours.eos_id)
    for text in ["First Citizen:\nBefore we proceed any further, hear me speak.",
                 "  leading spaces, tabs\tand unicode: café, naïve — ok?", ""]:
        ids = hf_tok(text)["input_ids"]
        assert ids == ours.encode(text)
        assert hf_tok.decode(ids) == ours.decode(ids)


def test_config_mismatch_names_the_field(export, tmp_path):
    _, folder = export("tiny")
    proc = subprocess.run(
        [sys.executable, "scripts/convert_hf.py", "from-hf", "--config", "llama_debug",
         "--model.flavor", "debug", "--hf", str(folder), "--out", str(tmp_path / "out")],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "convert_hf: error: the Hugging Face config does not match the Kiln flavor: "
        "hidden_size is 64 in config.json but 256 in the flavor"]
    assert not (tmp_path / "out").exists()


def test_bad_input_is_one_line(export, tmp_path, capsys):
    _, folder = export("tied")
    tiny_step = export("tiny")[1].parent / "step-3"
    cases = [  # (words the message must hold, flavor, command line)
        ("Hugging Face folder not found", "tied", ["from-hf", "--hf", str(tmp_path / "nope")]),
        ("no .metadata", "tied", ["to-hf", "--checkpoint", str(tmp_path / "nope")]),
        ("tie_word_embeddings is True in config.json but False", "tiny", ["from-hf", "--hf", str(folder)]),
        ("parameter 'tok_embeddings.weight' is [4096, 64] in the checkpoint but [4096, 256] in the model",
         "tiny", ["to-hf", "--checkpoint", str(tiny_step), "--model.name", "llama3",
                  "--model.flavor", "debug"]),
    ]
    for want, flavor, (command, *args) in cases:
        assert convert_here(flavor, command, *args, "--out", str(tmp_path / "out")) == 2, want
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("convert_hf: error: ") and want in lines[0], lines
    assert convert_here("tied", "from-hf", "--hf", str(folder), "--out", str(folder)) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_adapter_refuses_wrong_tensors(export):
    model, folder = export("tiny")
    adapter = LlamaStateDictAdapter(model.args)
    state = load_hf_state(folder)
    with pytest.raises(KilnError, match="lack 'model.layers.1.mlp.up_proj.weight'"):
        adapter.from_hf({k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(KilnError, match="model.layers.2.input_layernorm.weight"):
        adapter.from_hf({**state, "model.layers.2.input_layernorm.weight": torch.ones(64)})
    with pytest.raises(KilnError, match="no Kiln Llama name"):
        adapter.from_hf({**state, "model.vision_tower.weight": torch.ones(1)})
    wrong = dataclasses.replace(model.args, rope_theta=10000.0)
    with pytest.raises(KilnError, match="rope_theta is 500000.0 in config.json but 10000.0"):
        LlamaStateDictAdapter(wrong).args_from_hf_config(json.loads((folder / "config.json").read_text()))
