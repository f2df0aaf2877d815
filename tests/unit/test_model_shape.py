"""What the planner reads of a model's shape from meta models (planning/model_shape.py)."""

import dataclasses

import torch

from components.config.loading import load_config
from parallelisms.pipeline import make_stage_model
from planning.model_shape import (
    TensorParallelRows,
    block_parameters,
    block_tensor_parallel_rows,
    moe_flops_per_token,
    tensor_parallel_rows,
)
from training.assembly import load_model_family


def test_the_moe_layers_flops_count_the_router_the_shared_and_the_chosen_experts():
    """6 FLOPs per active parameter of every MoE layer (DeepSeek-V3's debug shape: dense first
    blocks, a shared expert): the router's dim × E, the shared experts' and top_k routed experts'
    three dim × hidden projections; a dense model has none."""
    spec, args = load_model_family(load_config(["--config", "deepseek_v3_debug"]))
    m = args.moe
    layers = args.n_layers - args.n_dense_layers + args.mtp_depth
    assert 0 < args.n_dense_layers < args.n_layers and m.num_shared_experts > 0
    active = args.dim * m.num_experts + 3 * args.dim * m.hidden_dim * (m.num_shared_experts + m.top_k)
    assert moe_flops_per_token(spec, args) == 6 * layers * active
    dense, dense_args = load_model_family(load_config(["--config", "llama_debug"]))
    assert moe_flops_per_token(dense, dense_args) == 0


def test_a_block_adds_its_parameters_and_of_them_its_routed_experts():
    spec, args = load_model_family(load_config(["--config", "deepseek_v3_debug"]))
    every, experts = block_parameters(spec, args)
    m = args.moe
    assert experts == 3 * args.dim * m.hidden_dim * m.num_experts and every > experts


def test_tp_rows_count_blocks_and_every_pass_through_the_ends():
    """Rows of a microbatch's tokens TP gathers and reduces at least, per token: Llama's blocks 4 each
    way, the embedding and the head one each. DeepSeek-V3's MLA runs its low-rank down projections
    whole and reduces their latents' gradients (q_lora + kv_lora + rope = 24 + 32 + 8 of dim 64: one
    row) instead of its input's; an MoE layer under EP reduces nothing. The last pipeline stage of an
    MTP model embeds the MTP ids with its copy of the embedding, and its head runs once per depth more."""
    spec, args = load_model_family(load_config(["--config", "llama_debug", "--model.flavor", "tiny"]))
    with torch.device("meta"):
        llama = spec.model_cls(args)
    assert tensor_parallel_rows(llama, False) == TensorParallelRows(4 * 2 + 2, 4 * 2 + 2, 1)
    first, last = make_stage_model(llama, [0], True, False), make_stage_model(llama, [1], False, True)
    assert tensor_parallel_rows(first, False) == TensorParallelRows(5, 5, 0)
    assert tensor_parallel_rows(last, False) == TensorParallelRows(5, 5, 1)

    spec, args = load_model_family(load_config(["--config", "deepseek_v3_debug", "--model.flavor", "tiny"]))
    latents = args.q_lora_rank + args.kv_lora_rank + args.qk_rope_head_dim
    assert (latents, args.n_dense_layers) == (args.dim, 1)
    mla = 1 + 1  # the output reduced and the latents' gradients
    assert block_tensor_parallel_rows(spec, args) == ((4, mla + 2), (4, mla))
    with torch.device("meta"):
        deepseek = spec.model_cls(dataclasses.replace(args, mtp_depth=1))
    # a dense block, an MoE block and the MTP module's; the MTP module's joining projection gathers its
    # two inputs; the embedding passes the tokens and the MTP ids, the head the main and MTP rows
    joined, ends = 2, 2 + 2
    assert tensor_parallel_rows(deepseek, True) == TensorParallelRows(
        3 * 4 + joined + ends, (mla + 2) + 2 * mla + joined + ends, 2, 1)
    last = make_stage_model(deepseek, [1], False, True)
    assert tensor_parallel_rows(last, False) == TensorParallelRows(
        2 * 4 + joined + 1 + 2, 2 * (mla + 2) + joined + 1 + 2, 2, 1)


def test_tp_rows_of_full_rank_queries_and_of_a_models_own_tp_plan():
    """MLA without q_lora_rank takes its queries from the input through a column-parallel wq, so its
    input's gradient is reduce-scattered besides its key-value latent's all-reduce (kv_lora + rope =
    40 of 64). A block outside Kiln's kind (the GPT-2 example's `attn`, its own TP plan): no floor."""
    spec, args = load_model_family(load_config(["--config", "deepseek_v3_debug", "--model.flavor", "tiny"]))
    full = dataclasses.replace(args, q_lora_rank=None)
    mla = 1 + 1 + (full.kv_lora_rank + full.qk_rope_head_dim) / full.dim
    assert block_tensor_parallel_rows(spec, full) == ((4, mla + 2), (4, mla))
    spec, args = load_model_family(load_config(["--config", "llama_debug", "--job.custom_import",
                                                "examples/gpt2_model.py", "--model.name", "gpt2",
                                                "--model.flavor", "tiny"]))
    with torch.device("meta"):
        assert tensor_parallel_rows(spec.model_cls(args), False) is None
    assert block_tensor_parallel_rows(spec, args) is None
