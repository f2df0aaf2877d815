"""DeepSeek-V3 ↔ Hugging Face: transformers' own DeepseekV3ForCausalLM, built from small random
configs with odd shapes, saved, imported into Kiln, gives Kiln's logits (fp32, 1e-4 relative) and
greedy generations; Kiln's export loads back into transformers with the same logits."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from components.checkpoint.hf_folder import load_hf_config, load_hf_state, save_hf_folder
from components.generation import generate
from components.runtime.errors import KilnError
from models import get_model_spec
from models.common.attention import causal_attention
from models.common.moe import MoEArgs, TopKRouter
from models.common.rope import YarnScaling, rope_cache
from models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter, args_from_hf

transformers = pytest.importorskip("transformers")  # a test-only dependency

TOKENIZER = Path(__file__).resolve().parents[2] / "assets" / "tokenizer" / "tokenizer.json"
VOCAB = 4096

# Odd shapes: 3 heads, nope 10 + rope 6 ≠ v 14, latent ranks 20/24, dense blocks then MoE blocks.
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=72, moe_intermediate_size=20,
            num_hidden_layers=4, num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=20,
            qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=14, max_position_embeddings=256,
            rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
YARN = {"rope_type": "yarn", "beta_fast": 32, "beta_slow": 1}
CASES = {
    # V3-like: low-rank queries, 12 experts in 4 groups (top 2 groups, top 3 experts), YaRN with
    # mscale ≠ mscale_all_dim (so both the table and the softmax scale move), 1 dense block.
    "v3_yarn_groups": dict(q_lora_rank=24, n_routed_experts=12, num_experts_per_tok=3, n_group=4,
                           topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                           routed_scaling_factor=2.5, norm_topk_prob=True, rope_theta=10000.0,
                           rope_scaling={**YARN, "factor": 4.0, "original_max_position_embeddings": 64,
                                         "mscale": 0.8, "mscale_all_dim": 0.6}),
    # V2-Lite-like: full-rank queries, no groups, no renormalisation, no YaRN, 2 dense blocks.
    "v2lite_plain": dict(q_lora_rank=None, n_routed_experts=6, num_experts_per_tok=2, n_group=1,
                         topk_group=1, n_shared_experts=2, first_k_dense_replace=2, routed_scaling_factor=1.0,
                         norm_topk_prob=False, rope_theta=5000.0),
    # 4 groups of 3 experts, only the best group kept, and YaRN with equal mscales (as V3).
    "one_group_yarn": dict(q_lora_rank=16, n_routed_experts=12, num_experts_per_tok=2, n_group=4,
                           topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                           routed_scaling_factor=1.7, norm_topk_prob=True, rope_theta=10000.0,
                           rope_scaling={**YARN, "factor": 8.0, "original_max_position_embeddings": 32,
                                         "mscale": 1.0, "mscale_all_dim": 1.0}),
}


def hf_model(case: str) -> torch.nn.Module:
    """transformers' model for a case, seeded, with weights and expert biases large enough that a
    mapping or routing mistake shows in the logits."""
    config = transformers.DeepseekV3Config(**BASE, **CASES[case])
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif "experts" in name or name.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
            elif p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    return model


def imported(folder: Path) -> torch.nn.Module:
    """Kiln's model from a Hugging Face folder, the way a conversion reads it: args from config.json,
    weights through the adapter."""
    spec = get_model_spec("deepseek_v3")
    assert "deepseek_v3" in spec.hf_model_types
    args = spec.args_from_hf(load_hf_config(folder))
    model = spec.model_cls(args)
    model.init_weights()
    adapter = spec.state_dict_adapter(args)
    adapter.args_from_hf_config(load_hf_config(folder))
    model.load_state_dict(adapter.from_hf(load_hf_state(folder)))
    return model.eval()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


TOKENS = torch.randint(0, VOCAB, (2, 37), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_logits_and_generations_match_kiln(tmp_path, case):
    hf = hf_model(case)
    hf.save_pretrained(tmp_path)
    ours = imported(tmp_path)
    with torch.no_grad():
        want, got = hf(TOKENS).logits, ours(TOKENS)
    err = relative(got, want)
    print(f"{case}: logits relative error {err:.2e}")
    assert err <= 1e-4
    # Greedy generation: transformers' generate against Kiln's (KV cache: MLA has the hooks).
    prompt = TOKENS[0, :9]
    theirs = hf.generate(prompt[None], max_new_tokens=12, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, 9:].tolist()
    assert generate(ours, prompt.tolist(), 12, temperature=0, note=lambda _: None) == theirs
    without_cache = generate(_without_kv_hooks(ours), prompt.tolist(), 12, temperature=0, note=lambda _: None)
    assert without_cache == theirs


@pytest.mark.parametrize("case", ["v3_yarn_groups", "v2lite_plain"])
def test_generation_caches_the_compressed_latent(tmp_path, case):
    """MLA's cache holds kv_lora_rank + qk_rope_head_dim numbers per token and layer (20 + 6 here,
    not 3 heads × (16 + 14)), and attending in the latent space gives the logits of a full forward,
    for a prompt of several tokens (the offset causal mask) and for each token after it."""
    from models.deepseek_v3.attention import LatentKVCache, MultiHeadLatentAttention

    hf = hf_model(case)
    hf.save_pretrained(tmp_path)
    model = imported(tmp_path)
    layers = [m for m in model.modules() if isinstance(m, MultiHeadLatentAttention)]
    caches = [m.make_kv_cache() for m in layers]
    for m, cache in zip(layers, caches, strict=True):
        m.core_attention = cache
    tokens = TOKENS[:, :12]
    with torch.no_grad():
        steps = []
        for start, end in ((0, 9), (9, 10), (10, 11), (11, 12)):
            model.rope_positions = torch.arange(start, end)
            steps.append(model(tokens[:, start:end]))
        for m in layers:
            m.core_attention = causal_attention
        model.rope_positions = None
        want = model(tokens)
    for cache in caches:
        assert isinstance(cache, LatentKVCache)
        assert cache.latent.shape == (2, 12, 20) and cache.k_pe.shape == (2, 12, 6)
    assert relative(torch.cat(steps, dim=1), want) <= 1e-5


class _Recompute(torch.nn.Module):
    """The model behind a wrapper without `rope_positions`: generation recomputes every token."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)


def _without_kv_hooks(model: torch.nn.Module) -> torch.nn.Module:
    return _Recompute(model)


@pytest.mark.parametrize("case", ["v3_yarn_groups", "v2lite_plain"])
def test_export_loads_in_transformers(tmp_path, case):
    hf = hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    ours = imported(tmp_path / "hf")
    adapter = DeepSeekV3StateDictAdapter(ours.args)
    save_hf_folder(tmp_path / "kiln", adapter.to_hf(ours.state_dict()), adapter.hf_config(1, 2), TOKENIZER,
                   torch.float32)
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "kiln", dtype=torch.float32).eval()
    with torch.no_grad():
        assert relative(back(TOKENS).logits, ours(TOKENS)) <= 1e-4
    # And the exported files read back into Kiln exactly.
    again = adapter.from_hf(load_hf_state(tmp_path / "kiln"))
    for name, w in ours.state_dict().items():
        assert torch.equal(again[name], w), name
    assert adapter.args_from_hf_config(adapter.hf_config(1, 2)) == ours.args


def test_fused_expert_files_read_as_per_expert_ones(tmp_path):
    """transformers 5 saves DeepSeek's per-expert names (as above); its in-memory fused layout
    (gate_up_proj [E, 2·I, dim] with gate first, down_proj [E, dim, I]) reads to the same weights."""
    hf = hf_model("v3_yarn_groups")
    hf.save_pretrained(tmp_path)
    ours = imported(tmp_path)
    adapter = DeepSeekV3StateDictAdapter(ours.args)
    per_expert = load_hf_state(tmp_path)
    fused = {k: v for k, v in per_expert.items() if ".mlp.experts." not in k}
    for i in range(ours.args.n_dense_layers, ours.args.n_layers):
        sd = ours.state_dict()
        prefix = f"model.layers.{i}.mlp.experts."
        fused[prefix + "gate_up_proj"] = torch.cat([sd[f"layers.{i}.moe.experts.w1"],
                                                    sd[f"layers.{i}.moe.experts.w3"]], dim=1)
        fused[prefix + "down_proj"] = sd[f"layers.{i}.moe.experts.w2"]
    again = adapter.from_hf(fused)
    for name, w in adapter.from_hf(per_expert).items():
        assert torch.equal(again[name], w), name
    # And transformers' own module, loaded from those files, holds exactly that fused layout.
    experts = hf.model.layers[1].mlp.experts
    torch.testing.assert_close(experts.gate_up_proj, fused["model.layers.1.mlp.experts.gate_up_proj"],
                               rtol=0, atol=0)


def test_yarn_table_matches_transformers():
    config = transformers.DeepseekV3Config(**BASE, **CASES["v3_yarn_groups"])
    rotary = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(config)
    x = torch.zeros(1)
    cos, sin = rotary(x, torch.arange(50)[None])
    ours = rope_cache(6, 50, 10000.0, args_from_hf(config.to_dict()).rope_scaling)
    torch.testing.assert_close(ours, torch.cat([cos[0, :, :3], sin[0, :, :3]], -1), rtol=1e-5, atol=1e-6)


def test_group_limited_routing():
    """Experts outside the chosen groups are never picked, even with the best single score; a group
    ranks by its two best scores' sum; one group is plain top-k."""
    args = MoEArgs(num_experts=6, top_k=2, score_func="sigmoid", num_groups=3, top_k_groups=1)
    router = TopKRouter(6, args)
    router.gate.weight.data = torch.eye(6)  # the input is the logits
    scores = torch.tensor([[0.9, 0.0, 0.6, 0.5, 0.1, 0.1]])  # group sums: 0.9, 1.1, 0.2
    logits = torch.logit(scores.clamp(1e-6, 1 - 1e-6))
    _, experts, _ = router(logits, None)
    assert sorted(experts[0].tolist()) == [2, 3]
    # The bias moves the choice of group too: +1 on expert 5 makes group 2 (sum 1.2) the best.
    _, experts, _ = router(logits, torch.tensor([0, 0, 0, 0, 0, 1.0]))
    assert sorted(experts[0].tolist()) == [4, 5]
    router.args = dataclasses.replace(args, num_groups=1)
    _, experts, _ = router(logits, None)
    assert sorted(experts[0].tolist()) == [0, 2]


def test_what_kiln_does_not_implement_is_refused_in_one_error():
    config = {**BASE, **CASES["v2lite_plain"], "model_type": "deepseek_v3", "hidden_act": "gelu",
              "attention_bias": True, "rope_interleave": False, "rope_scaling": {"rope_type": "dynamic"},
              "quantization_config": {"quant_method": "fp8"}}
    with pytest.raises(KilnError) as e:
        args_from_hf(config)
    for field in ("hidden_act", "attention_bias", "rope_interleave", "dynamic", "quantized"):
        assert field in str(e.value)
    assert "\n" not in str(e.value)


def test_flavor_yarn_scales():
    """The 671B flavor's YaRN: mscale 1 and mscale_all_dim 1 leave the table alone and scale the softmax."""
    from models.common.rope import yarn_softmax_factor, yarn_table_factor
    v3 = get_model_spec("deepseek_v3").flavors["671B"]
    assert isinstance(v3.rope_scaling, YarnScaling)
    assert yarn_table_factor(v3.rope_scaling) == 1.0
    assert yarn_softmax_factor(v3.rope_scaling) == pytest.approx((0.1 * math.log(40) + 1) ** 2)


def test_layout_check_names_what_tp_cannot_split():
    from types import SimpleNamespace

    from models.deepseek_v3.parallelize import check_deepseek_v3
    tiny = get_model_spec("deepseek_v3").flavors["tiny"]
    assert check_deepseek_v3(tiny, SimpleNamespace(tp=2, cp=2)) == []
    problems = check_deepseek_v3(tiny, SimpleNamespace(tp=3, cp=1))
    assert any("tensor_parallel_degree 3" in p and "128" in p for p in problems), problems
    bad = dataclasses.replace(tiny, moe=dataclasses.replace(tiny.moe, num_groups=3))
    assert "groups" in check_deepseek_v3(bad, SimpleNamespace(tp=1, cp=1))[0]


def test_document_mask_keeps_documents_apart():
    """With document masking and restarted positions, a second document in a window gives the logits
    it has on its own (MLA's per-row RoPE table and block-causal mask)."""
    spec = get_model_spec("deepseek_v3")
    torch.manual_seed(0)
    model = spec.model_cls(spec.flavors["tiny"])
    model.init_weights()
    model.eval()
    tokens = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    tokens[:, 0] = tokens[:, 10] = 1
    with torch.no_grad():
        alone = model(tokens[:, 10:])
        model.document_bos_id, model.restart_positions = 1, True
        packed = model(tokens)
    torch.testing.assert_close(packed[:, 10:], alone, rtol=1e-5, atol=1e-5)
