"""The least communication a layout needs, beside what the planned step sends.

FSDP's floor per step: every parameter gathered twice (for the forward, and again for the backward
after the forward resharded it; once where the forward's weights stay gathered, as a pipeline's do)
in the dtype it computes in, and every gradient reduce-scattered once in the reduce dtype; HSDP
adds one all-reduce of the gradient shard across replicas. More than that is a code path or a
setting that sends more: gradient accumulation gathers and reduce-scatters once per microbatch, a
pipeline schedule per microbatch of its stage. (DDP's floor: the all-reduce.) Under EP the routed
experts shard over what EP leaves of dp_shard × cp (dp_shard_mod_ep), the rest over all of it:
each group's floor is its own.

Expert parallel's floor per step: each routed (token, choice) row sent to its expert's rank and its
output sent back, and both again as gradients in backward. Tensor parallel's: each block's attention
and feed-forward (or MoE layer) gather their input sequence and reduce-scatter their output, and
their backward the reverse for the gradients, in the compute dtype (planning/model_shape.py's
tensor_parallel_rows says where Kiln's plans need less); an all-reduce counts as a reduction. More
is named: autocast's float32 norms, loss parallel off, AC's recomputed forwards, an MoE layer
without EP summing its input's gradient by all-reduces, an MTP module's output planned as gloo's
all-gather. (CP and the pipeline's sends, TP under float8, whose linears gather in float8, and a
model's own TP plan: no floor is claimed.)
"""

from __future__ import annotations

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_FSDP = ("dp_shard", "dp_shard_cp")


def fsdp_gathers(pp: int, reshard_after_forward: str) -> int:
    """Gathers of each parameter a step needs at least: one where the forward's gathered weights stay
    for the backward (a pipeline's default, parallelisms/fsdp.py, or resharding "never"), else two."""
    kept = reshard_after_forward == "never" or (reshard_after_forward == "default" and pp > 1)
    return 1 if kept else 2


def fsdp_floor(parameters: dict[str, int], shard: int, replicas: int, param_dtype: str, reduce_dtype: str,
               gathers: int = 2, reductions: int = 1) -> dict[str, dict[str, int]]:
    """{kind: bytes} under "fsdp" and "dp_replicate": the floor of a rank whose parameter shards over
    `shard` ranks weigh `parameters` as stored (bytes by dtype, the master copy) — or, given, the
    bytes of that many gathers and reduce-scatters of them (a step of several microbatches)."""
    elements = sum(nbytes // _BYTES.get(dtype, 4) for dtype, nbytes in parameters.items()) * shard
    floor = {}
    if shard > 1:
        floor["fsdp"] = {"all-gather": gathers * elements * _BYTES[param_dtype],
                         "reduce-scatter": reductions * elements * _BYTES[reduce_dtype]}
    if replicas > 1:  # HSDP's replicas (DDP's where a shard is one rank)
        floor["dp_replicate"] = {"all-reduce": reductions * elements // shard * _BYTES[reduce_dtype]}
    return floor


def sharded_floor(groups: list[tuple[str, dict[str, int], int, int]], replicas: int, param_dtype: str,
                  reduce_dtype: str, reductions: int = 1) -> dict[str, dict[str, float]]:
    """FSDP's floor of parameters sharded and gathered differently — (the dimension the floor is
    named by, bytes by dtype as stored, ranks sharding them, gathers per step) — such as EP's
    experts over dp_shard_mod_ep and the rest over dp_shard, or a model's blocks gathered twice and
    its embedding once: each dimension's summed, HSDP's all-reduces too (every group is replicated
    over dp_replicate)."""
    floor: dict[str, dict[str, float]] = {}
    for name, parameters, shard, gathers in groups:
        part = fsdp_floor(parameters, shard, replicas, param_dtype, reduce_dtype, gathers, reductions)
        for dim, kinds in part.items():
            into = floor.setdefault(name if dim == "fsdp" else dim, {})
            for kind, nbytes in kinds.items():
                into[kind] = into.get(kind, 0) + nbytes
    return floor


def rank_floor_groups(parameters: dict[str, int], blocks: dict[str, int], experts: dict[str, int],
                      degrees: dict[str, int], gathers: int) -> list[tuple[str, dict[str, int], int, int]]:
    """A planned rank's stored parameters as sharded_floor's groups: its blocks' gathered `gathers`
    times, the rest once (the embedding's backward needs no weights; the final norm and the head are
    never resharded: parallelisms/fsdp.py); under EP the routed experts (of the blocks) over what
    EP leaves of dp_shard × cp."""
    shard, ep = degrees["dp_shard"] * degrees["cp"], degrees.get("ep", 1)
    routed = experts if ep > 1 else {}
    other_blocks = {dtype: n - routed.get(dtype, 0) for dtype, n in blocks.items()}
    outside = {dtype: n - blocks.get(dtype, 0) for dtype, n in parameters.items()}
    groups = [("fsdp", other_blocks, shard, gathers), ("fsdp", outside, shard, 1)]
    if routed:
        groups.append(("dp_shard_mod_ep", routed, shard // ep, gathers))
    return groups


def expert_parallel_floor(moe_layers: float, tokens: float, top_k: int, dim: int, dtype: str
                          ) -> dict[str, dict[str, float]]:
    """{"ep": {"all-to-all": bytes}}: a rank that routes `tokens` per step through `moe_layers` MoE
    layers sends 4 × tokens × top_k rows of `dim` elements per layer (dispatch and combine, forward
    and backward), its own rows included, as the planner counts an all-to-all; activation
    checkpointing sends its recomputed forward's again."""
    return {"ep": {"all-to-all": 4 * moe_layers * tokens * top_k * dim * _BYTES[dtype]}}


def tensor_parallel_floor(gathers: float, reductions: float, tokens: float, dim: int, dtype: str,
                          loss_passes: float = 0) -> dict[str, dict[str, float]]:
    """{"tp": {kind: bytes}}: a TP group whose ranks hold `tokens` per step between them gathers
    `gathers` rows of `dim` elements per token and reduce-scatters `reductions` (as
    model_shape.tensor_parallel_rows counts them); loss parallel's cross-entropy all-reduces three
    float32 numbers per token on each of `loss_passes` passes through the head (the logits' max, the
    sum of their exponentials, the label's logit), counted with the reductions, as every all-reduce
    of TP is (all_reduces_as_reductions)."""
    row = tokens * dim * _BYTES[dtype]
    return {"tp": {"all-gather": gathers * row,
                   "reduce-scatter": reductions * row + loss_passes * tokens * 3 * _BYTES["float32"]}}


def all_reduces_as_reductions(communication: dict[str, dict[str, int]], dim: str = "tp"
                              ) -> dict[str, dict[str, int]]:
    """The step's bytes with `dim`'s all-reduces counted as reduce-scatters: an all-reduce reduces as a
    reduce-scatter does (and gathers too), so one that stands where a reduce-scatter would do is
    held to the reductions' floor rather than going below it."""
    out = {}
    for label, kinds in communication.items():
        kinds = dict(kinds)
        if dim in label.split(" = ") and "all-reduce" in kinds:
            kinds["reduce-scatter"] = kinds.get("reduce-scatter", 0) + kinds.pop("all-reduce")
        out[label] = kinds
    return out


def against_floor(communication: dict[str, dict[str, int]], floor: dict[str, dict[str, int]]
                  ) -> list[tuple[str, str, float]]:
    """(group, kind, sent / floor) for each floored collective the step issued. A group that is
    several dimensions' ("dp_shard = ep") carries each one's: its floor is theirs summed."""
    out = []
    for label, kinds in communication.items():
        keys = {"fsdp" if dim in _FSDP else dim for dim in label.split(" = ")}
        for kind, nbytes in kinds.items():
            least = sum(floor.get(key, {}).get(kind, 0) for key in keys)
            if least:
                out.append((label, kind, nbytes / least))
    return out
