"""Qwen3 (dense and MoE) against transformers' own Qwen3ForCausalLM / Qwen3MoeForCausalLM: a model
transformers builds and saves is imported through the state-dict adapter and gives the same fp32
logits and greedy generations in Kiln; exported back, transformers loads it and gives Kiln's logits.
Also the config reader (args_from_hf), its refusals, and the published sizes of the flavors. The
parallel layouts are tests/e2e/test_qwen3_runs.py."""

import dataclasses

import pytest
import torch

from components.checkpoint.hf_folder import kiln_state_from_hf, load_hf_config, load_hf_state, save_hf_folder
from components.generation import generate
from components.runtime.errors import KilnError
from models import get_model_spec
from models.qwen3.state_dict_adapter import Qwen3StateDictAdapter, args_from_hf
from tests.helpers.runs import REPO

transformers = pytest.importorskip("transformers")  # a test-only dependency

TOKENIZER = REPO / "assets" / "tokenizer" / "tokenizer.json"
# Odd shapes: GQA with one KV head, head_dim 12 ≠ 48 / 6, 3 blocks.
SHAPE = dict(vocab_size=4096, hidden_size=48, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=1, head_dim=12, intermediate_size=72, max_position_embeddings=256,
             rope_theta=1e6, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)


def hf_model(moe: bool, tie: bool = False) -> torch.nn.Module:
    """transformers' own model from a small random config, with weights large enough (norms far from
    one, the QK-norms included) that a mapping or permutation mistake shows in the logits."""
    if moe:
        config = transformers.Qwen3MoeConfig(**SHAPE, tie_word_embeddings=tie, num_experts=5,
                                             num_experts_per_tok=2, moe_intermediate_size=20,
                                             norm_topk_prob=True)
    else:
        config = transformers.Qwen3Config(**SHAPE, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = (transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(("q_proj.weight", "k_proj.weight", "gate.weight")):
                p.normal_(0.0, 0.3)
            elif "experts" in name:
                p.normal_(0.0, 0.2)
    return model.eval()


def kiln_from_folder(folder) -> tuple[torch.nn.Module, Qwen3StateDictAdapter]:
    """What an import does: config.json → args (args_from_hf), the model, the adapter's weights."""
    spec = get_model_spec("qwen3")
    args = spec.args_from_hf(load_hf_config(folder))
    adapter = spec.state_dict_adapter(args)
    model = spec.model_cls(args)
    model.init_weights()
    model.load_state_dict(kiln_state_from_hf(folder, adapter))
    return model.eval(), adapter


def assert_same_logits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    rel = (ours - theirs).abs().max() / theirs.abs().max()
    assert rel.item() <= 1e-4, rel.item()


CASES = {"dense": (False, False), "dense_tied": (False, True), "moe": (True, False), "moe_tied": (True, True)}


@pytest.mark.parametrize("case", CASES)
def test_transformers_qwen3_imports_exports_and_agrees(case, tmp_path):
    moe, tie = CASES[case]
    hf = hf_model(moe, tie)
    hf.save_pretrained(tmp_path / "hf")
    model, adapter = kiln_from_folder(tmp_path / "hf")
    assert (model.args.moe is not None) == moe and model.args.tie_embeddings == tie
    assert model.args.head_dim == 12 and model.args.kv_heads == 1
    tokens = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
        assert_same_logits(ours, hf(tokens).logits)
        assert_same_logits(model(tokens.flip(1)), hf(tokens.flip(1)).logits)  # another routing mix
    # Greedy generation: Kiln's KV-cache path against transformers' generate.
    prompt = tokens[0, :8].tolist()
    ours_gen = generate(model, prompt, 12, temperature=0, note=lambda _: None)
    theirs_gen = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
    assert ours_gen == theirs_gen
    # Export: transformers loads Kiln's files and gives Kiln's logits.
    save_hf_folder(tmp_path / "out", adapter.to_hf(model.state_dict()), adapter.hf_config(1, 2), TOKENIZER,
                   torch.float32)
    back_cls = transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM
    back = back_cls.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        assert_same_logits(ours, back(tokens).logits)
    # The exported files are exactly what transformers itself saved (per-expert tensors included).
    exported, saved = load_hf_state(tmp_path / "out"), load_hf_state(tmp_path / "hf")
    assert set(exported) == set(saved) - ({"lm_head.weight"} if tie else set())
    for name, w in exported.items():
        assert torch.equal(w, saved[name]), name


def test_fused_expert_layout_reads_too():
    """transformers 5's in-memory tensors (gate_up_proj, down_proj stacked over experts) import as well."""
    hf = hf_model(moe=True)
    args = args_from_hf(hf.config.to_dict())
    fused = Qwen3StateDictAdapter(args).from_hf(dict(hf.state_dict()))
    model = get_model_spec("qwen3").model_cls(args)
    model.load_state_dict(fused)
    tokens = torch.randint(0, 4096, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_same_logits(model.eval()(tokens), hf(tokens).logits)


@pytest.mark.parametrize("flavor", list(get_model_spec("qwen3").flavors))
def test_args_from_hf_round_trip(flavor):
    """Every flavor's config.json reads back into the same args (the training-only fields aside)."""
    args = get_model_spec("qwen3").flavors[flavor]
    adapter = Qwen3StateDictAdapter(args)
    back = args_from_hf(adapter.hf_config(1, 2))
    assert back == dataclasses.replace(args, depth_init=back.depth_init)
    assert adapter.args_from_hf_config(adapter.hf_config(1, 2)) == args


def test_unsupported_config_fields_are_refused_in_one_error():
    config = Qwen3StateDictAdapter(get_model_spec("qwen3").flavors["8B"]).hf_config(1, 2)
    config |= {"use_sliding_window": True, "sliding_window": 4096, "attention_bias": True,
               "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(KilnError) as e:
        args_from_hf(config)
    for fragment in ("attention_bias", "use_sliding_window", "'yarn'"):
        assert fragment in str(e.value)
    moe = Qwen3StateDictAdapter(get_model_spec("qwen3").flavors["30B-A3B"]).hf_config(1, 2)
    with pytest.raises(KilnError, match=r"mlp_only_layers is \[0\]"):
        args_from_hf(moe | {"mlp_only_layers": [0]})
    with pytest.raises(KilnError, match="model_type 'llama'"):
        args_from_hf(config | {"model_type": "llama"})
    # A config of another shape than the flavor is named by its first difference.
    with pytest.raises(KilnError, match="head_dim is 64 in config.json but 128"):
        Qwen3StateDictAdapter(get_model_spec("qwen3").flavors["8B"]).args_from_hf_config(
            Qwen3StateDictAdapter(get_model_spec("qwen3").flavors["8B"]).hf_config(1, 2) | {"head_dim": 64})


def test_export_refuses_what_qwen3_cannot_express():
    spec = get_model_spec("qwen3")
    args = spec.flavors["moe_tiny"]
    model = spec.model_cls(args)
    model.init_weights()
    sd = model.state_dict()
    sd["layers.1.moe.expert_bias"] = torch.full((8,), 0.01)
    with pytest.raises(KilnError, match=r"layers\.1\.moe\.expert_bias is not zero"):
        Qwen3StateDictAdapter(args).to_hf(sd)
    with pytest.raises(KilnError, match="shared experts"):
        shared = dataclasses.replace(args.moe, num_shared_experts=1)
        Qwen3StateDictAdapter(dataclasses.replace(args, moe=shared))
    hf = Qwen3StateDictAdapter(args).to_hf(model.state_dict())
    del hf["model.layers.0.mlp.experts.3.down_proj.weight"]
    with pytest.raises(KilnError, match=r"experts \[0, 1, 2, 4, 5, 6, 7\]"):
        Qwen3StateDictAdapter(args).from_hf(hf)


def test_published_sizes():
    """Total (and active) parameters of the published shapes, in billions, as Qwen states them."""
    from models.moe.model import inactive_expert_params

    spec = get_model_spec("qwen3")
    published = {"0.6B": 0.6, "1.7B": 1.7, "4B": 4.0, "8B": 8.2, "14B": 14.8, "32B": 32.8,
                 "30B-A3B": (30.5, 3.3), "235B-A22B": (235.1, 22.2)}
    for flavor, want in published.items():
        args = spec.flavors[flavor]
        with torch.device("meta"):
            total = sum(p.numel() for p in spec.model_cls(args).parameters())
        if args.moe is None:
            assert total / 1e9 == pytest.approx(want, abs=0.05), flavor
        else:
            active = total - inactive_expert_params(args)
            assert (total / 1e9, active / 1e9) == pytest.approx(want, abs=0.1), flavor


# The config.json files of the published checkpoints (Qwen/Qwen3-0.6B, -8B, -30B-A3B), as released
# (transformers 4.51 form: rope_theta, rope_scaling null, num_experts).
_PUBLISHED_COMMON = {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
                     "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02,
                     "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_scaling": None,
                     "rope_theta": 1000000, "sliding_window": None, "torch_dtype": "bfloat16",
                     "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
                     "vocab_size": 151936}
PUBLISHED = {
    "0.6B": {**_PUBLISHED_COMMON, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
             "hidden_size": 1024, "intermediate_size": 3072, "max_window_layers": 28,
             "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
             "tie_word_embeddings": True},
    "8B": {**_PUBLISHED_COMMON, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
           "hidden_size": 4096, "intermediate_size": 12288, "max_window_layers": 36,
           "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
           "tie_word_embeddings": False},
    "30B-A3B": {**_PUBLISHED_COMMON, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "decoder_sparse_step": 1, "hidden_size": 2048, "intermediate_size": 6144,
                "max_window_layers": 48, "mlp_only_layers": [], "moe_intermediate_size": 768,
                "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
                "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
                "output_router_logits": False, "router_aux_loss_coef": 0.001, "tie_word_embeddings": False},
}


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_published_config_reads_into_the_flavor(flavor):
    assert args_from_hf(PUBLISHED[flavor]) == get_model_spec("qwen3").flavors[flavor]
