"""The least communication a layout needs, beside what the planned step sends.

FSDP's floor per step: every parameter gathered twice (for the forward, and again for the backward
after the forward resharded it) in the dtype it computes in, and every gradient reduce-scattered
once in the reduce dtype; HSDP adds one all-reduce of the gradient shard across replicas. More than
that is a code path or a setting that sends more: gradient accumulation gathers and reduce-scatters
once per microbatch, a pipeline schedule per microbatch of its stage. (TP, CP, EP and the pipeline's
sends scale with the activations the layout moves by design: no floor is claimed for them.)
"""

from __future__ import annotations

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_FSDP = ("dp_shard", "dp_shard_cp")


def fsdp_floor(parameters: dict[str, int], degrees: dict[str, int], param_dtype: str, reduce_dtype: str
               ) -> dict[str, dict[str, int]]:
    """{kind: bytes} per FSDP dimension: the floor of a rank whose stored parameter shards weigh
    `parameters` (bytes by dtype, the master copy)."""
    shard = degrees["dp_shard"] * degrees["cp"]
    if shard <= 1 or degrees.get("ep", 1) > 1:  # experts shard over another degree: not claimed
        return {}
    elements = sum(nbytes // _BYTES.get(dtype, 4) for dtype, nbytes in parameters.items()) * shard
    floor = {"all-gather": 2 * elements * _BYTES[param_dtype],
             "reduce-scatter": elements * _BYTES[reduce_dtype]}
    if degrees["dp_replicate"] > 1:
        return {"fsdp": floor, "dp_replicate": {"all-reduce": elements // shard * _BYTES[reduce_dtype]}}
    return {"fsdp": floor}


def against_floor(communication: dict[str, dict[str, int]], floor: dict[str, dict[str, int]]
                  ) -> list[tuple[str, str, float]]:
    """(dimension, kind, sent / floor) for each floored collective the step issued."""
    out = []
    for label, kinds in communication.items():
        dim = label.split(" = ")[0]
        key = "fsdp" if dim in _FSDP else dim
        for kind, nbytes in kinds.items():
            least = floor.get(key, {}).get(kind)
            if least:
                out.append((label, kind, nbytes / least))
    return out
