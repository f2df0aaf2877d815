"""Parallelize the MoE transformer: Llama's TP plan for attention, TP or EP for the MoE layers."""

from collections.abc import Callable

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
    RowwiseParallel,
)

from components.config.parallel_options import ParallelOptions
from components.optim.expert_balance import moe_layers
from models.llama3.parallelize import attention_plan, feed_forward_plan
from models.moe.model import MoEModelArgs
from parallelisms.compose import finish_parallelize, tensor_parallelize
from parallelisms.expert_parallel import apply_ep
from parallelisms.parallel_dims import ParallelDims
from parallelisms.tensor_parallel import ReplicateParallel, StackedShard, sum_gradients_over


def moe_tp_plan() -> dict[str, ParallelStyle]:
    """TP inside an MoE layer: every TP rank routes the whole (gathered) sequence, holds a slice of
    every expert's hidden units (and of the shared experts'), and the partial outputs are
    reduce-scattered back to sequence shards."""
    return {
        "moe": PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Partial(),), desired_output_layouts=(Shard(1),), use_local_output=True,
        ),
        "moe.router.gate": ReplicateParallel(),
        "moe.experts": StackedShard({"w1": 1, "w3": 1, "w2": 2}),
        "moe.shared_experts.w1": ColwiseParallel(),
        "moe.shared_experts.w3": ColwiseParallel(),
        "moe.shared_experts.w2": RowwiseParallel(output_layouts=Partial()),
    }


def moe_tp_plan_with_ep() -> dict[str, ParallelStyle]:
    """TP around an expert-parallel MoE layer: the layer is not split over TP ranks — each runs it on
    the whole (gathered) sequence, so its output is already complete and only needs cutting back
    to this rank's sequence shard. Redundant work on TP ranks, but exact; splitting experts over
    TP as well (TorchTitan's expert-tensor parallel) is not implemented."""
    return {
        "moe": PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True,
        ),
        "moe.router.gate": ReplicateParallel(),
        "moe.shared_experts.w1": ReplicateParallel(),
        "moe.shared_experts.w2": ReplicateParallel(),
        "moe.shared_experts.w3": ReplicateParallel(),
    }


def check_moe(args: MoEModelArgs, dims: ParallelDims) -> list[str]:
    """The MoE family's own check (ModelSpec.check_fn): a token cannot choose more experts than exist."""
    m = args.moe
    if m.top_k > m.num_experts:
        return [f"the MoE layers choose top_k = {m.top_k} of only {m.num_experts} experts"]
    return []


def parallelize_moe(model: nn.Module, dims: ParallelDims, options: ParallelOptions,
                    attention: Callable[[bool], dict[str, ParallelStyle]] = attention_plan) -> nn.Module:
    """TP → EP → CP → AC → compile → FSDP (experts over what EP leaves of dp_shard × cp). `attention`
    (float8) is the TP plan of a block's attention and norms (another family's attention brings its own)."""
    moes = [m for _, m in moe_layers([model])]
    dense_block = attention(options.float8) | feed_forward_plan(options.float8)
    moe_block = attention(options.float8) | (moe_tp_plan_with_ep() if dims.ep > 1 else moe_tp_plan())
    tensor_parallelize(model, dims, options,
                       lambda block: moe_block if getattr(block, "moe_enabled", False) else dense_block)
    if dims.tp > 1 and dims.ep == 1:
        for moe in moes:
            moe.partial_grad_sync = sum_gradients_over(dims.mesh("tp"))
    if dims.ep == 1:
        return finish_parallelize(model, dims, options)
    apply_ep(moes, dims.mesh("ep"))

    def shard_experts(policy: MixedPrecisionPolicy) -> None:
        # Expert weights: FSDP over what EP leaves of dp_shard × cp (see ExpertParallelDispatch for
        # how their gradients still average over all of dp × cp). FSDP shards dim 0, the experts:
        # with fewer local experts than FSDP ranks (Mixtral's 8 over EP 8 × 8) every rank would keep
        # a whole padded expert, so then the experts' rows (dim 1) are sharded instead.
        local_experts = moes[0].experts.w1.shape[0] // dims.ep if moes else 0
        placement = (lambda _: Shard(1)) if local_experts < dims.mesh("dp_shard_mod_ep").size() else None
        for moe in moes:
            fully_shard(moe.experts, mesh=dims.expert_fsdp_mesh(), mp_policy=policy,
                        reshard_after_forward=dims.pp == 1, shard_placement_fn=placement)

    return finish_parallelize(model, dims, options, shard_experts)
