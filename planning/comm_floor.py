"""The least communication a layout needs, beside what the planned step sends.

FSDP's floor per step: every parameter gathered twice (for the forward, and again for the backward
after the forward resharded it) in the dtype it computes in, and every gradient reduce-scattered
once in the reduce dtype; HSDP adds one all-reduce of the gradient shard across replicas. More than
that is a code path or a setting that sends more: gradient accumulation gathers and reduce-scatters
once per microbatch, a pipeline schedule per microbatch of its stage. (DDP's floor: the all-reduce.)

Expert parallel's floor per step: each routed (token, choice) row sent to its expert's rank and its
output sent back, and both again as gradients in backward. Tensor parallel's: each block's attention
gathers its input sequence and reduce-scatters its output (an all-reduce moves as much), and its
backward the same for their gradients. (CP and the pipeline's sends: no floor is claimed.)
"""

from __future__ import annotations

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_FSDP = ("dp_shard", "dp_shard_cp")


def fsdp_floor(parameters: dict[str, int], degrees: dict[str, int], param_dtype: str, reduce_dtype: str,
               gathers: int = 2, reductions: int = 1) -> dict[str, dict[str, int]]:
    """{kind: bytes} per FSDP dimension: the floor of a rank whose stored parameter shards weigh
    `parameters` (bytes by dtype, the master copy) — or, given, the bytes of that many gathers and
    reduce-scatters of them (a step of several microbatches, or weights kept gathered after forward)."""
    shard = degrees["dp_shard"] * degrees["cp"]
    if degrees.get("ep", 1) > 1:  # experts shard over another degree: not claimed
        return {}
    elements = sum(nbytes // _BYTES.get(dtype, 4) for dtype, nbytes in parameters.items()) * shard
    floor = {}
    if shard > 1:
        floor["fsdp"] = {"all-gather": gathers * elements * _BYTES[param_dtype],
                         "reduce-scatter": reductions * elements * _BYTES[reduce_dtype]}
    if degrees["dp_replicate"] > 1:  # HSDP's replicas (DDP's where a shard is one rank)
        floor["dp_replicate"] = {"all-reduce": reductions * elements // shard * _BYTES[reduce_dtype]}
    return floor


def expert_parallel_floor(moe_layers: float, tokens: float, top_k: int, dim: int, dtype: str
                          ) -> dict[str, dict[str, float]]:
    """{"ep": {"all-to-all": bytes}}: a rank that routes `tokens` per step through `moe_layers` MoE
    layers sends 4 × tokens × top_k rows of `dim` elements per layer (dispatch and combine, forward
    and backward), its own rows included, as the planner counts an all-to-all; activation
    checkpointing sends its recomputed forward's again."""
    return {"ep": {"all-to-all": 4 * moe_layers * tokens * top_k * dim * _BYTES[dtype]}}


def tensor_parallel_floor(blocks: float, tokens: float, dim: int, dtype: str) -> dict[str, dict[str, float]]:
    """{"tp": {kind: bytes}}: a TP group whose ranks hold `tokens` per step between them, through
    `blocks` blocks, gathers `dim` elements per token twice per block (attention's input, forward;
    its output's gradient, backward) and reduce-scatters as many."""
    nbytes = 2 * blocks * tokens * dim * _BYTES[dtype]
    return {"tp": {"all-gather": nbytes, "reduce-scatter": nbytes}}


def against_floor(communication: dict[str, dict[str, int]], floor: dict[str, dict[str, int]]
                  ) -> list[tuple[str, str, float]]:
    """(dimension, kind, sent / floor) for each floored collective the step issued."""
    out = []
    for label, kinds in communication.items():
        for dim in label.split(" = "):  # a group of several dimensions ("dp_shard = ep") is each one's
            key = "fsdp" if dim in _FSDP else dim
            for kind, nbytes in kinds.items():
                least = floor.get(key, {}).get(kind)
                if least:
                    out.append((label, kind, nbytes / least))
    return out
