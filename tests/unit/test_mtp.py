"""Multi-token prediction (models/common/mtp.py) on DeepSeek-V3: the loss a forward leaves equals one
computed by hand from the paper's recipe, the main logits do not change, the Hugging Face names
follow DeepSeek's releases, and the pipeline cut and the option's refusals. The parallel layouts are
tests/e2e/test_deepseek_v3_runs.py."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from components.runtime.errors import KilnError
from models import get_model_args, get_model_spec, with_mtp_depth
from models.common.mtp import IGNORE_INDEX, next_tokens_of
from models.deepseek_v3.model import deepseek_v3_flops_per_token
from models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
from parallelisms.pipeline import make_stage_model


def tiny(depth: int) -> tuple[torch.nn.Module, object]:
    spec = get_model_spec("deepseek_v3")
    args = with_mtp_depth(spec, get_model_args(spec, "tiny"), depth)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    return model.eval(), args


def test_next_tokens_shift_the_labels():
    labels = torch.tensor([[5, 6, IGNORE_INDEX, 8]])
    got = next_tokens_of(labels, 2)
    assert got.shape == (1, 4, 3)
    assert got[0, :, 0].tolist() == [5, 6, IGNORE_INDEX, 8]
    assert got[0, :, 1].tolist() == [6, IGNORE_INDEX, 8, IGNORE_INDEX]
    assert got[0, :, 2].tolist() == [IGNORE_INDEX, 8, IGNORE_INDEX, IGNORE_INDEX]


def test_loss_is_the_papers_recipe():
    """Depth k at position i: embed token i+k, join with the previous depth's state (the main
    model's normed output for k = 1), one block, its norm, the shared head, predict token i+k+1."""
    model, args = tiny(2)
    tokens = torch.randint(0, args.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, args.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    labels[1, 4] = IGNORE_INDEX
    with torch.no_grad():
        plain = model(tokens)
        logits = model(tokens, next_tokens=next_tokens_of(labels, 2))
        h = model.tok_embeddings(tokens)
        rope = model.rope_cache
        for layer in model.layers.values():
            h = layer(h, rope)
        previous = model.norm(h)
        total, count = 0.0, 0
        for k, module in enumerate(model.mtp.values(), start=1):
            # Token i + k is labels[i + k - 1]; its target labels[i + k]; the rest of the row is padding.
            ids = torch.zeros_like(tokens)
            ids[:, : 11 - k + 1] = labels[:, k - 1:].clamp(min=0)
            joined = torch.cat([module.enorm(model.tok_embeddings(ids)), module.hnorm(previous)], -1)
            previous = module.block(module.eh_proj(joined), rope)
            scores = model.output(module.norm(previous))
            for b in range(2):
                for i in range(11 - k):
                    source, target = labels[b, i + k - 1].item(), labels[b, i + k].item()
                    if IGNORE_INDEX in (source, target):
                        continue
                    total += F.cross_entropy(scores[b, i], torch.tensor(target), reduction="sum").item()
                    count += 1
    assert torch.equal(logits, plain)
    assert model.mtp_tokens.item() == count == 2 * (10 + 9) - 4  # the ignored label costs 2 per depth
    assert model.mtp_loss.item() == pytest.approx(total, rel=1e-5)
    assert list(model.mtp) == ["2", "3"]  # keyed by the block index each would have


def test_no_next_tokens_no_mtp():
    model, args = tiny(1)
    model(torch.zeros(1, 5, dtype=torch.long))
    assert model.mtp_loss is None


def test_hf_names_as_released_and_back():
    model, args = tiny(1)
    adapter = DeepSeekV3StateDictAdapter(args)
    sd = model.state_dict()
    hf = adapter.to_hf(sd)
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "embed_tokens.weight", "shared_head.head.weight", "self_attn.kv_a_proj_with_mqa.weight",
                 "mlp.experts.7.down_proj.weight", "mlp.gate.e_score_correction_bias"):
        assert f"model.layers.2.{name}" in hf, name
    assert torch.equal(hf["model.layers.2.embed_tokens.weight"], sd["tok_embeddings.weight"])
    back = adapter.from_hf(hf)
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    # A flavor without MTP reads the main model and passes the MTP block by.
    plain_args = dataclasses.replace(args, mtp_depth=0)
    main = DeepSeekV3StateDictAdapter(plain_args).from_hf(hf)
    assert main.keys() == {k for k in sd if not k.startswith("mtp.")}
    # A flavor with MTP refuses a folder without it, saying why.
    without = {k: v for k, v in hf.items() if not k.startswith("model.layers.2.")}
    with pytest.raises(KilnError, match="num_nextn_predict_layers = 1 asks for multi-token prediction"):
        adapter.from_hf(without)
    assert adapter.hf_config(1, 2)["num_nextn_predict_layers"] == 1


def test_last_pipeline_stage_holds_the_modules_and_an_embedding():
    model, args = tiny(1)
    first = make_stage_model(model, [0], True, False)
    last = make_stage_model(model, [1], False, True)
    assert first.mtp is None and first.tok_embeddings is not None
    assert last.mtp is not None and last.tok_embeddings is not None and last.output is not None
    tokens = torch.randint(0, args.vocab_size, (2, 9))
    labels = torch.randint(0, args.vocab_size, (2, 9))
    ahead = next_tokens_of(labels, 1)
    with torch.no_grad():
        whole = model(tokens, next_tokens=ahead)
        whole_loss = model.mtp_loss
        staged = last(first(tokens, next_tokens=ahead), next_tokens=ahead)
    assert torch.equal(staged, whole) and torch.equal(last.mtp_loss, whole_loss)


def test_only_a_family_with_mtp_takes_the_option():
    llama = get_model_spec("llama3")
    with pytest.raises(KilnError, match="model 'llama3' has no multi-token prediction"):
        with_mtp_depth(llama, get_model_args(llama, "tiny"), 1)
    args = get_model_args(llama, "tiny")
    assert with_mtp_depth(llama, args, 0) is args and with_mtp_depth(llama, args, -1) is args


def test_flops_count_the_modules():
    spec = get_model_spec("deepseek_v3")
    args0 = get_model_args(spec, "tiny")
    args1 = dataclasses.replace(args0, mtp_depth=1)
    params0 = sum(p.numel() for p in tiny(0)[0].parameters())
    params1 = sum(p.numel() for p in tiny(1)[0].parameters())
    f0 = deepseek_v3_flops_per_token(args0, params0, 64)
    f1 = deepseek_v3_flops_per_token(args1, params1, 64)
    m = args0.moe
    inactive = (m.num_experts - m.top_k) * 3 * args0.dim * m.hidden_dim
    attention = 6 * args0.n_heads * (args0.qk_head_dim + args0.v_head_dim) * 64
    assert f1 - f0 == 6 * (params1 - params0 - inactive + args0.vocab_size * args0.dim) + attention
    assert get_model_args(spec, "671B").mtp_depth == 1


def test_activation_checkpointing_and_compile_reach_the_mtp_block():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from parallelisms.activation_checkpoint import apply_ac
    from parallelisms.compile import apply_compile

    model, _ = tiny(1)
    apply_ac(model, "full")
    assert isinstance(model.mtp["2"].block, CheckpointWrapper)
    assert all(isinstance(b, CheckpointWrapper) for b in model.layers.values())
    model, _ = tiny(1)
    apply_compile(model)
    assert model.mtp["2"].block._compiled_call_impl is not None
