"""Parallelize the MoE transformer: Llama's TP plan for attention, TP or EP for the MoE layers."""

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
    RowwiseParallel,
)

from components.config import JobConfig
from components.errors import KilnError
from models.common.moe import MoE
from models.llama3.parallelize import finish_parallelize, llama_tp_plan, tensor_parallelize
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


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def parallelize_moe(model: nn.Module, dims: ParallelDims, cfg: JobConfig, param_dtype: str) -> nn.Module:
    """TP → EP → CP → AC → compile → FSDP (experts over what EP leaves of dp_shard × cp)."""
    bad = [m.args for m in moe_layers(model) if m.args.top_k > m.args.num_experts]
    if bad:
        raise KilnError(f"the MoE layers choose top_k = {bad[0].top_k} of only {bad[0].num_experts} experts")
    _, dense_plan = llama_tp_plan(loss_parallel=not cfg.parallelism.disable_loss_parallel)
    moe_plan = moe_tp_plan_with_ep() if dims.ep > 1 else moe_tp_plan()
    moe_block_plan = {k: v for k, v in dense_plan.items() if not k.startswith("feed_forward")} | moe_plan
    tensor_parallelize(model, dims, cfg,
                       lambda block: moe_block_plan if getattr(block, "moe_enabled", False) else dense_plan)
    if dims.tp > 1 and dims.ep == 1:
        for moe in moe_layers(model):
            moe.partial_grad_sync = sum_gradients_over(dims.mesh("tp"))
    before_fsdp = None
    if dims.ep > 1:
        try:
            apply_ep(moe_layers(model), dims.mesh("ep"))
        except ValueError as e:
            raise KilnError(str(e)) from None

        def before_fsdp(policy: MixedPrecisionPolicy) -> None:
            # Expert weights: FSDP over what EP leaves of dp_shard × cp (see ExpertParallelDispatch
            # for how their gradients still average over all of dp × cp).
            for moe in moe_layers(model):
                fully_shard(moe.experts, mesh=dims.expert_fsdp_mesh(), mp_policy=policy,
                            reshard_after_forward=dims.pp == 1)

    return finish_parallelize(model, dims, cfg, param_dtype, before_fsdp)
