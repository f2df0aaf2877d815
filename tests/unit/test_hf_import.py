"""A model shape from a Hugging Face config.json (models/hf_import.py, ModelSpec.args_from_hf): odd
shapes read exactly, from transformers' own config classes, and every field Kiln does not implement
is refused by name. The import as a user runs it is tests/e2e/test_hf_import_runs.py."""

import dataclasses

import pytest

from components.runtime.errors import KilnError
from models import get_model_spec
from models.common.rope import RopeScaling
from models.hf_import import args_from_hf_config, supported_model_types
from models.llama3.state_dict_adapter import LlamaStateDictAdapter

transformers = pytest.importorskip("transformers")  # a test-only dependency

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 1024}


def llama(**kw) -> dict:
    """A LlamaConfig of an odd shape, in transformers' own dict form."""
    shape = dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=1,
                 intermediate_size=200, vocab_size=1000, max_position_embeddings=4096, rms_norm_eps=1e-5,
                 rope_theta=250000.0)
    return transformers.LlamaConfig(**{**shape, **kw}).to_dict()


def mixtral(**kw) -> dict:
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=40, vocab_size=512, num_local_experts=4, num_experts_per_tok=3,
                 max_position_embeddings=256, router_aux_loss_coef=0.02)
    return transformers.MixtralConfig(**{**shape, **kw}).to_dict()


def test_supported_types_name_their_families():
    types = supported_model_types()
    assert types["llama"] == "llama3" and types["mixtral"] == "moe"


def test_llama_odd_shape_is_exact():
    spec, args = args_from_hf_config(llama())
    assert spec.name == "llama3"
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads, args.vocab_size) == (96, 3, 6, 1, 1000)
    assert args.ffn_dim == 200 and args.head_dim == 16  # intermediate_size kept, not re-derived
    assert (args.norm_eps, args.rope_theta, args.max_seq_len) == (1e-5, 250000.0, 4096)
    assert args.rope_scaling is None and not args.tie_embeddings
    model = spec.model_cls(args)
    assert model.layers["0"].feed_forward.w1.weight.shape == (200, 96)
    assert model.layers["0"].attention.wk.weight.shape == (16, 96)


def test_llama_tied_and_rope_scaled():
    _, args = args_from_hf_config(llama(tie_word_embeddings=True, rope_scaling=LLAMA3_SCALING))
    assert args.tie_embeddings
    assert args.rope_scaling == RopeScaling(scale_factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                            original_max_seq_len=1024)


@pytest.mark.parametrize("flavor", ["tiny", "1B", "8B"])
def test_kiln_export_reads_back_to_the_same_model(flavor):
    """A Kiln flavor's own config.json reads back to args that build the same model."""
    args = get_model_spec("llama3").flavors[flavor]
    _, back = args_from_hf_config(LlamaStateDictAdapter(args).hf_config(0, 1))
    for field in ("dim", "n_layers", "n_heads", "kv_heads", "vocab_size", "ffn_dim", "norm_eps",
                  "rope_theta", "rope_scaling", "max_seq_len", "tie_embeddings"):
        assert getattr(back, field) == getattr(args, field), field


def test_existing_flavors_keep_their_feed_forward():
    """ffn_hidden_dim defaults to None: every flavor keeps Meta's sizing."""
    for args in get_model_spec("llama3").flavors.values():
        assert args.ffn_hidden_dim is None


def test_mixtral_routing_as_the_adapter_assumes():
    spec, args = args_from_hf_config(mixtral())
    assert spec.name == "moe"
    m = args.moe
    assert (m.num_experts, m.top_k, m.hidden_dim, m.num_shared_experts) == (4, 3, 40, 0)
    assert (m.score_func, m.route_norm, m.route_scale, m.load_balance_coeff) == ("softmax", True, 1.0, None)
    assert m.aux_loss_coeff == 0.02 and args.n_dense_layers == 0 and args.kv_heads == 2
    spec.state_dict_adapter(args)  # the Mixtral adapter accepts the shape


@pytest.mark.parametrize("make, change, words", [
    (llama, {"attention_bias": True}, "attention_bias = true"),
    (llama, {"mlp_bias": True}, "mlp_bias = true"),
    (llama, {"head_dim": 32}, "head_dim = 32"),
    (llama, {"hidden_act": "gelu"}, 'hidden_act = "gelu"'),
    (llama, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, 'rope_type = "linear"'),
    (llama, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}},
     'rope_type = "yarn"'),
    (llama, {"attention_dropout": 0.1}, "attention_dropout = 0.1"),
    (mixtral, {"sliding_window": 128}, "sliding_window = 128"),
    (mixtral, {"tie_word_embeddings": True}, "tie_word_embeddings = true"),
    (mixtral, {"router_jitter_noise": 0.01}, "router_jitter_noise = 0.01"),
    (mixtral, {"head_dim": 8}, "head_dim = 8"),
])
def test_unimplemented_fields_are_refused_by_name(make, change, words):
    config = make()
    config.update(change)
    if "rope_scaling" in change:  # transformers 5 keeps RoPE in rope_parameters
        config.pop("rope_parameters", None)
    with pytest.raises(KilnError, match="does not implement") as e:
        args_from_hf_config(config)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_unsupported_model_type_lists_the_supported_ones():
    with pytest.raises(KilnError) as e:
        args_from_hf_config({**llama(), "model_type": "gpt2"})
    message = str(e.value)
    assert "model_type 'gpt2'" in message and "llama (llama3)" in message and "mixtral (moe)" in message


def test_a_missing_size_is_named():
    config = llama()
    del config["intermediate_size"]
    with pytest.raises(KilnError, match="intermediate_size = null"):
        args_from_hf_config(config)


# The config.json files of the published checkpoints (as on the hub), which Kiln has flavors of.
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
    "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 32000}


@pytest.mark.parametrize("config, family, flavor", [(LLAMA31_8B, "llama3", "8B"),
                                                     (MIXTRAL_8X7B, "moe", "mixtral_8x7b")])
def test_published_configs_read_as_kilns_flavors(config, family, flavor):
    """What the hub's config.json gives is Kiln's hand-written flavor, up to how the FFN size is given."""
    spec, args = args_from_hf_config(config)
    want = spec.flavors[flavor]
    assert spec.name == family and args.ffn_dim == want.ffn_dim
    same = dataclasses.replace(args, multiple_of=want.multiple_of, ffn_dim_multiplier=want.ffn_dim_multiplier,
                               ffn_hidden_dim=None)
    assert same == want
