"""Parallelize the DeepSeek-V3 model: the MoE family's order and pieces (parallelize_moe: TP or EP
for the MoE layers, the experts sharded over what EP leaves, then CP → AC → compile → FSDP) with a
tensor-parallel plan of its own for multi-head latent attention. Pipeline parallel cuts it as any
model of the contract; under context parallel MLA pads its values to the keys' width, as the ring
attention gathers keys and values stacked (MultiHeadLatentAttention.pad_values_to_keys).

TP for MLA, as TorchTitan's: the low-rank down projections (wq_a, wkv_a) and their norms run whole on
every TP rank (ReplicateParallel), the up projections (wq or wq_b, wkv_b) split the heads column-wise
and wo gathers them row-wise back to sequence shards. The rotary key k_pe comes whole out of wkv_a
but each rank uses it for its own heads only, so its gradient is summed over TP
(MultiHeadLatentAttention.shared_key_grad_sync).
"""

from functools import partial

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from components.config.parallel_options import ParallelOptions
from models.deepseek_v3.model import DeepSeekV3Args
from models.moe.parallelize import parallelize_moe
from parallelisms.parallel_dims import ParallelDims
from parallelisms.tensor_parallel import ReplicateParallel, linear_styles, model_blocks, sum_gradients_over


def mla_plan(float8: bool = False, *, q_lora: bool) -> dict[str, ParallelStyle]:
    """Both norms sequence-parallel; MLA gathers the sequence, runs its down projections whole and
    splits its heads (float8: torchao's styles for the split linears)."""
    ColwiseParallel, RowwiseParallel, PrepareModuleInput = linear_styles(float8)  # noqa: N806
    plan = {
        "attention_norm": SequenceParallel(),
        "ffn_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wkv_a": ReplicateParallel(),
        "attention.kv_norm": ReplicateParallel(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    if q_lora:
        plan |= {"attention.wq_a": ReplicateParallel(), "attention.q_norm": ReplicateParallel(),
                 "attention.wq_b": ColwiseParallel()}
    else:
        plan["attention.wq"] = ColwiseParallel()
    return plan


def parallelize_deepseek_v3(model: nn.Module, dims: ParallelDims, options: ParallelOptions) -> nn.Module:
    """Turn the plain (meta-device) model into this rank's part of the parallel model, in place."""
    for block in model_blocks(model):
        if dims.tp > 1:
            block.attention.shared_key_grad_sync = sum_gradients_over(dims.mesh("tp"))
        block.attention.pad_values_to_keys = dims.cp > 1
    return parallelize_moe(model, dims, options, partial(mla_plan, q_lora=bool(model.args.q_lora_rank)))


def check_deepseek_v3(args: DeepSeekV3Args, dims: ParallelDims) -> list[str]:
    """The family's own check (ModelSpec.check_fn): its routing fits its experts, and TP splits the
    dense and expert hidden sizes evenly."""
    m, out = args.moe, []
    per_group = m.num_experts // max(m.num_groups, 1)
    if m.num_groups < 1 or m.num_experts % m.num_groups:
        out.append(f"the MoE layers' {m.num_groups} expert groups do not divide their {m.num_experts} "
                   "experts")
    elif not 1 <= m.top_k_groups <= m.num_groups or m.top_k > m.top_k_groups * per_group:
        out.append(f"the MoE layers choose top_k = {m.top_k} experts within top_k_groups = {m.top_k_groups} "
                   f"of {m.num_groups} groups of {per_group}")
    if dims.tp > 1:
        sizes = {"the dense blocks' hidden size": args.inter_dim, "the experts' hidden size": m.hidden_dim,
                 "the shared experts' hidden size": m.hidden_dim * m.num_shared_experts}
        out += [f"tensor_parallel_degree {dims.tp} must divide {what} {size}"
                for what, size in sizes.items() if size % dims.tp]
    return out
