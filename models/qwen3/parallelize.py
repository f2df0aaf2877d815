"""Qwen3's tensor-parallel plan: Llama's (or the MoE family's) plus the QK-norms; every other
parallelism comes in the shared order of parallelisms/compose.py.

Under TP each rank holds some of the heads, and the QK-norms act on each head alone, so they run on
the local heads with their weight replicated: SequenceParallel over the heads dimension (dim 2 of
[batch, seq, heads, head_dim]) says exactly that, as TorchTitan's Qwen3 does. Each rank's weight
gradient then covers its heads only; backward leaves it a Partial DTensor, summed over the TP ranks
with the sequence-parallel norms' (parallelisms/partial_gradients.py).
"""

from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel, parallelize_module

from components.config.parallel_options import ParallelOptions
from models.llama3.parallelize import parallelize_llama
from models.moe.parallelize import check_moe, parallelize_moe
from parallelisms.parallel_dims import ParallelDims


def qk_norm_plan() -> dict[str, ParallelStyle]:
    """The QK-norms on this rank's heads (dim 2), weights replicated, outputs local tensors again."""
    return {"attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)}


def parallelize_qwen3(model: nn.Module, dims: ParallelDims, options: ParallelOptions) -> nn.Module:
    """The QK-norms' plan, then Llama's parallelize (dense) or the MoE family's (TP or EP for the MoE
    layers): TP → EP → CP → AC → compile → FSDP."""
    if dims.tp > 1:
        for block in model.layers.values():
            parallelize_module(block, dims.mesh("tp"), qk_norm_plan())
    if model.args.moe is None:
        return parallelize_llama(model, dims, options)
    return parallelize_moe(model, dims, options)


def check_qwen3(args: Any, dims: ParallelDims) -> list[str]:
    """TP splits the feed-forward's (or each expert's) hidden units evenly; top_k within the experts."""
    if args.moe is not None:
        problems = check_moe(args, dims)
        if dims.tp > 1 and dims.ep == 1 and args.moe.hidden_dim % dims.tp:
            problems.append(f"tensor_parallel_degree {dims.tp} must divide the experts' hidden size "
                            f"{args.moe.hidden_dim}")
        return problems
    if dims.tp > 1 and args.hidden_dim % dims.tp:
        return [f"tensor_parallel_degree {dims.tp} must divide the feed-forward hidden size "
                f"{args.hidden_dim}"]
    return []
