"""MoE ↔ Hugging Face Mixtral: transformers' MixtralForCausalLM gives Kiln's logits from exported
files, the round trip is exact, and flavors Mixtral cannot express are refused by name."""

import dataclasses
from pathlib import Path

import pytest
import torch

from components.checkpoint.hf_folder import load_hf_state, save_hf_folder
from components.runtime.errors import KilnError
from models import get_model_spec
from models.moe.state_dict_adapter import MixtralStateDictAdapter

transformers = pytest.importorskip("transformers")  # a test-only dependency

TOKENIZER = Path(__file__).resolve().parents[2] / "assets" / "tokenizer" / "tokenizer.json"


def mixtral_like_model() -> torch.nn.Module:
    """The tiny MoE reshaped as Mixtral (softmax, renormalised top 2, no shared expert, no bias),
    seeded with weights large enough that a mapping mistake shows in the logits."""
    spec = get_model_spec("moe")
    tiny = spec.flavors["tiny"]
    args = dataclasses.replace(tiny, moe=dataclasses.replace(
        tiny.moe, num_shared_experts=0, route_norm=True, load_balance_coeff=None, num_experts=4))
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            if name.endswith(("wq.weight", "wk.weight", "gate.weight")):
                p.normal_(0.0, 0.3)
            if ".experts." in name:
                p.normal_(0.0, 0.2)
    return model.eval()


def test_transformers_mixtral_gives_kiln_logits(tmp_path):
    model = mixtral_like_model()
    adapter = MixtralStateDictAdapter(model.args)
    save_hf_folder(tmp_path, adapter.to_hf(model.state_dict()), adapter.hf_config(1, 2), TOKENIZER,
                   torch.float32)
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    # Both route the same: a second token mix through the same files agrees as well.
    with torch.no_grad():
        torch.testing.assert_close(model(tokens.flip(1)), hf(tokens.flip(1)).logits, atol=1e-4, rtol=1e-4)


def test_round_trip_is_exact(tmp_path):
    model = mixtral_like_model()
    adapter = MixtralStateDictAdapter(model.args)
    save_hf_folder(tmp_path, adapter.to_hf(model.state_dict()), adapter.hf_config(1, 2), TOKENIZER,
                   torch.float32)
    back = adapter.from_hf(load_hf_state(tmp_path))
    ours = model.state_dict()
    assert set(back) == set(ours)
    for name, w in ours.items():
        assert torch.equal(back[name], w), name
    assert adapter.args_from_hf_config(adapter.hf_config(1, 2)) == model.args


def test_unexpressible_flavors_and_states_are_refused():
    debug = get_model_spec("moe").flavors["debug"]  # plain softmax top-k, one shared expert
    with pytest.raises(KilnError, match="renormalised softmax"):
        MixtralStateDictAdapter(debug)
    with pytest.raises(KilnError, match="shared experts"):
        normed = dataclasses.replace(debug.moe, route_norm=True)
        MixtralStateDictAdapter(dataclasses.replace(debug, moe=normed))
    model = mixtral_like_model()
    sd = model.state_dict()
    sd["layers.1.moe.expert_bias"] = torch.full((4,), 0.01)
    with pytest.raises(KilnError, match=r"layers\.1\.moe\.expert_bias is not zero"):
        MixtralStateDictAdapter(model.args).to_hf(sd)
    hf = MixtralStateDictAdapter(model.args).to_hf(model.state_dict())
    del hf["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    with pytest.raises(KilnError, match="experts"):
        MixtralStateDictAdapter(model.args).from_hf(hf)
