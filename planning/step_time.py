"""A step's time from what the planner measured: its FLOPs against the device's peak at a
calibrated efficiency, each mesh dimension's collectives over the link they cross, and what of
them the layout hides behind compute (docs/planning.md, "The step-time model").

    step = compute × recompute / (1 − bubble) + exposed communication

- compute: the step's training FLOPs on this rank (FLOPs per token × tokens per step ÷ world; with
  TP and EP both, the MoE layers tp times over: each TP rank runs them whole) over peak × efficiency
  (× the compile and float8 speed-ups, which the efficiency table holds); activation
  checkpointing recomputes the forward of what it drops (full: +1/3);
- a collective of `n` ranks moves its counted bytes times (n − 1)/n (all-gather, reduce-scatter,
  all-to-all) or 2(n − 1)/n (all-reduce) over the slowest link its ranks span — within a node
  (NVLink) when the dimension's ranks fit in one, else the network — plus (n − 1) latencies a call;
- what is exposed: FSDP's gathers and reduce-scatters (and HSDP's and DDP's all-reduce) overlap
  with the other blocks' compute, so all but one block's share hides while compute lasts; tensor,
  context and expert parallel's collectives and the pipeline's sends sit on the critical path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A collective's bytes on the wire per byte the planner counts for it (ring algorithms), by kind.
_WIRE = {"all-gather": 1.0, "reduce-scatter": 1.0, "all-to-all": 1.0, "all-reduce": 2.0}
# Mesh dimensions whose collectives overlap with compute (FSDP, HSDP, DDP).
_OVERLAPPED = ("dp_shard", "dp_shard_cp", "dp_replicate", "dp")


@dataclass(frozen=True)
class Links:
    """What a rank's collectives cross: ranks per node, bandwidth per rank in one direction (GB/s)
    and latency per ring step (µs), within a node and across nodes."""

    per_node: int
    intra_gb_s: float
    inter_gb_s: float
    intra_us: float
    inter_us: float


@dataclass(frozen=True)
class Efficiency:
    """The calibrated constants: the share of the dense peak an eager step reaches, the speed-ups of
    compile and of float8 linears, the share of link bandwidth collectives reach, and how much of
    FSDP's traffic can hide behind compute (1 on GPUs, where it runs on its own streams)."""

    compute: float
    compile: float = 1.0
    float8: float = 1.0
    comm: float = 0.8
    overlap: float = 1.0


@dataclass(frozen=True)
class LayoutFacts:
    """What the model needs to know about a layout besides its measured bytes."""

    degrees: dict[str, int]  # pp, dp_replicate, dp_shard, cp, tp, ep
    layers_per_stage: int
    ac_mode: str = "none"
    selective_ac_option: str = "op"
    compile: bool = False
    float8: bool = False


@dataclass
class StepTime:
    """A predicted step: its parts in seconds and the tokens/s per device they give."""

    compute: float
    bubble: float
    comm: dict[str, float] = field(default_factory=dict)  # mesh dimension → seconds on the wire
    exposed: dict[str, float] = field(default_factory=dict)  # mesh dimension → seconds not hidden
    seconds: float = 0.0
    tokens_per_second_per_device: float = 0.0


def group_span(dim: str, d: dict[str, int]) -> tuple[int, int]:
    """(ranks in a group of this mesh dimension, how many consecutive ranks one group spans): the
    mesh is (pp, dp_replicate, dp_shard, cp, tp), tp innermost; the expert mesh's ep sits on tp."""
    tp, cp, shard, rep = d["tp"], d["cp"], d["dp_shard"], d["dp_replicate"]
    sizes = {"tp": (tp, 1), "cp": (cp, tp), "dp_shard": (shard, cp * tp),
             "dp_replicate": (rep, shard * cp * tp), "pp": (d["pp"], rep * shard * cp * tp),
             "dp": (rep * shard, cp * tp), "dp_shard_cp": (shard * cp, tp),
             "dp_cp": (rep * shard * cp, tp), "ep": (d["ep"], tp),
             "dp_shard_mod_ep": (shard * cp // max(d["ep"], 1), d["ep"] * tp)}
    size, stride = sizes.get(dim, (1, 1))
    return size, size * stride


def rank_flops(flops_per_token: float, moe_flops_per_token: float, tokens: float, world: int,
               degrees: dict[str, int]) -> float:
    """A rank's share of a step's training FLOPs (before recompute): every token's ÷ world, and with
    TP and EP both, the MoE layers' `moe_flops_per_token` (tp − 1) times more: each TP rank runs
    them whole on the whole sequence (models/moe/parallelize.py), redundant work a step waits for."""
    redundant = moe_flops_per_token * (degrees["tp"] - 1) if degrees.get("ep", 1) > 1 else 0.0
    return (flops_per_token + redundant) * tokens / world


def recompute_factor(mode: str, option: str) -> float:
    """Training FLOPs with activation checkpointing over those without (a forward is 1/3 of a step)."""
    if mode == "full":
        return 4 / 3
    if mode == "selective" and option.isdigit():
        return 1 + 1 / (3 * int(option))
    return 1.0  # selective per op recomputes elementwise ops only


def collective_seconds(kind: str, nbytes: float, calls: int, n: int, intra: bool, links: Links,
                       eff: Efficiency) -> float:
    """One dimension's traffic of one kind: its bytes on the wire over the link, plus latencies."""
    bandwidth = (links.intra_gb_s if intra else links.inter_gb_s) * 1e9 * eff.comm
    latency = (links.intra_us if intra else links.inter_us) * 1e-6
    if kind in _WIRE:
        share = _WIRE[kind] * (n - 1) / max(n, 1)
        return share * nbytes / bandwidth + calls * _WIRE[kind] * (n - 1) * latency
    return nbytes / bandwidth + calls * latency  # send/recv, broadcast


def predict(flops: float, bubble: float, communication: dict[str, dict[str, int]],
            calls: dict[str, dict[str, int]], tokens_per_device: float, facts: LayoutFacts,
            peak_tflops: float, links: Links, eff: Efficiency) -> StepTime:
    """The step time of one rank that computes `flops` (its share of the step, before recompute) and
    issues `communication` (mesh dimension → kind → bytes; `calls` alike)."""
    speed = eff.compute * (eff.compile if facts.compile else 1.0) * (eff.float8 if facts.float8 else 1.0)
    recompute = recompute_factor(facts.ac_mode, facts.selective_ac_option)
    compute = flops * recompute / (peak_tflops * 1e12 * speed)
    step = StepTime(compute=compute, bubble=bubble)
    overlapped = {}
    for label, kinds in communication.items():
        dim = label.split(" = ")[0]
        n, span = group_span(dim, facts.degrees)
        if n <= 1:
            n = 2  # a dimension the planner could not name: assume a pair within a node
        seconds = {kind: collective_seconds(kind, nbytes, calls.get(label, {}).get(kind, 0), n,
                                            span <= links.per_node, links, eff)
                   for kind, nbytes in kinds.items()}
        step.comm[label] = sum(seconds.values())
        # an all-to-all is EP's, on the critical path, also on a group that is FSDP's too ("dp_shard = ep")
        hidden = sum(s for kind, s in seconds.items() if kind != "all-to-all") if dim in _OVERLAPPED else 0.0
        step.exposed[label] = step.comm[label] - hidden
        if hidden > 0:
            overlapped[label] = hidden
    # FSDP's (and HSDP's, DDP's) traffic hides behind the compute of the blocks it is not for: all
    # but one block's share while compute lasts, shared by every such dimension.
    total = sum(overlapped.values())
    if total > 0:
        layers = max(facts.layers_per_stage, 1)
        exposed = max(total / layers, total - eff.overlap * compute * (layers - 1) / layers)
        for label, s in overlapped.items():
            step.exposed[label] += s * exposed / total
    step.seconds = compute / (1.0 - bubble) + sum(step.exposed.values())
    step.tokens_per_second_per_device = tokens_per_device / step.seconds if step.seconds > 0 else 0.0
    return step
