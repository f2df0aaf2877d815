"""Parallelize the DeepSeek-V3 model: FSDP (and HSDP/DDP) and expert parallel, through the MoE
family's parallelize_moe (EP over the MoE layers, the experts sharded over what EP leaves).

Not yet: a tensor-parallel plan for multi-head latent attention, pipeline and context parallel on
this family; check_deepseek_v3 refuses them at start-up rather than run a wrong layout.
"""

from models.deepseek_v3.model import DeepSeekV3Args
from models.moe.parallelize import parallelize_moe
from parallelisms.parallel_dims import ParallelDims

parallelize_deepseek_v3 = parallelize_moe


def check_deepseek_v3(args: DeepSeekV3Args, dims: ParallelDims) -> list[str]:
    """The family's own check (ModelSpec.check_fn): its routing fits its experts, and the layout uses
    only the parallelisms implemented for it."""
    m, out = args.moe, []
    per_group = m.num_experts // max(m.num_groups, 1)
    if m.num_groups < 1 or m.num_experts % m.num_groups:
        out.append(f"the MoE layers' {m.num_groups} expert groups do not divide their {m.num_experts} "
                   "experts")
    elif not 1 <= m.top_k_groups <= m.num_groups or m.top_k > m.top_k_groups * per_group:
        out.append(f"the MoE layers choose top_k = {m.top_k} experts within top_k_groups = {m.top_k_groups} "
                   f"of {m.num_groups} groups of {per_group}")
    for degree, name in ((dims.tp, "tensor_parallel_degree"), (dims.pp, "pipeline_parallel_degree"),
                         (dims.cp, "context_parallel_degree")):
        if degree > 1:
            out.append(f"model deepseek_v3 does not support {name} > 1 yet (FSDP/HSDP/DDP and "
                       "expert_parallel_degree are supported); set it to 1")
    return out
