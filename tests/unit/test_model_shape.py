"""What the planner reads of a model's shape from meta models (planning/model_shape.py)."""

from components.config.loading import load_config
from planning.model_shape import block_parameters, moe_flops_per_token
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
