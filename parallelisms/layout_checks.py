"""Every reason a layout cannot run a model, found before anything is built and listed at once.

ParallelDims.check_layout() is the one entry point; the degrees alone are checked when a
ParallelDims is made, and a model family adds its own problems through its ModelSpec.check_fn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from components.config.parallel_options import ParallelOptions
from components.runtime.errors import KilnError
from parallelisms.pipeline import parse_stage_layers, split_layers, stages_per_rank

if TYPE_CHECKING:
    from parallelisms.parallel_dims import ParallelDims


@dataclass(frozen=True)
class ModelShape:
    """What the layout checks need to know of a model (read from its args, see models/protocol.py)."""

    n_heads: int
    n_kv_heads: int
    n_layers: int
    vocab_size: int | None = None  # None: not checked
    max_seq_len: int | None = None  # None: not checked
    tied_embeddings: bool = False
    untied_flavors: tuple[str, ...] = ()  # flavors of the same family without tied embeddings
    num_experts: int | None = None  # None: a dense model
    can_pipeline: bool = True  # the model family knows how to cut itself into stages

    @classmethod
    def from_args(cls, args: Any, can_pipeline: bool) -> ModelShape:
        """Read from a flavor's args: the contract's fields, tie_embeddings and moe if present."""
        from models import untied_flavors  # models import the parallelisms: imported when called

        tied = bool(getattr(args, "tie_embeddings", False))
        return cls(n_heads=args.n_heads, n_kv_heads=args.kv_heads, n_layers=args.n_layers,
                   vocab_size=args.vocab_size, max_seq_len=args.max_seq_len, tied_embeddings=tied,
                   untied_flavors=tuple(untied_flavors(args)) if tied else (),
                   num_experts=getattr(getattr(args, "moe", None), "num_experts", None),
                   can_pipeline=can_pipeline)


def unusable_degrees(dp_replicate: int, dp_shard: int, cp: int, tp: int, pp: int, ep: int,
                     world_size: int) -> list[str]:
    """Degrees nothing else can be checked against: below 1, or a -1 that cannot be filled."""
    out = [f"parallel degree {name} must be >= 1, got {value}" for name, value in
           (("dp_replicate", dp_replicate), ("cp", cp), ("tp", tp), ("pp", pp), ("ep", ep)) if value < 1]
    others = dp_replicate * cp * tp * pp
    if out:
        return out
    if dp_shard == -1 and world_size % others:
        out.append(f"cannot fill data_parallel_shard_degree=-1: world size {world_size} is not divisible "
                   f"by dp_replicate {dp_replicate} × cp {cp} × tp {tp} × pp {pp} = {others}")
    elif dp_shard < 1 and dp_shard != -1:
        out.append(f"data_parallel_shard_degree must be -1 or >= 1, got {dp_shard}")
    return out


def degree_problems(dp_replicate: int, dp_shard: int, cp: int, tp: int, pp: int, ep: int,
                    world_size: int) -> list[str]:
    """The degrees against the world size (dp_shard already resolved from -1 where it could be)."""
    out = unusable_degrees(dp_replicate, dp_shard, cp, tp, pp, ep, world_size)
    if out:
        return out
    product = dp_replicate * dp_shard * cp * tp * pp
    if product != world_size:
        out.append(f"parallel degrees multiply to {product} (dp_replicate {dp_replicate} × dp_shard "
                   f"{dp_shard} × cp {cp} × tp {tp} × pp {pp}) but the world size is {world_size}")
    if ep > 1 and (dp_shard * cp) % ep:
        out.append(f"expert_parallel_degree {ep} must divide dp_shard × cp = {dp_shard * cp} (EP "
                   "borrows its ranks from those dimensions)")
    return out


def layout_problems(dims: ParallelDims, model: ModelShape, options: ParallelOptions, *,
                    device_type: str = "cpu", global_batch: int | None = None,
                    local_batch: int | None = None, document_mask: bool = False) -> list[str]:
    """One sentence per problem, each naming the option and the numbers; [] when the layout fits.
    The degrees themselves are checked by degree_problems."""
    problems = (_tp_problems(dims, model, options, device_type) + _cp_problems(dims, options)
                + _ep_problems(dims, model) + _pp_problems(dims, model, options, global_batch)
                + _batch_problems(dims, global_batch, local_batch))
    if model.max_seq_len is not None and options.seq_len > model.max_seq_len:
        problems.insert(0, f"training.seq_len {options.seq_len} exceeds the model's max_seq_len "
                           f"{model.max_seq_len}")
    if document_mask and (dims.pp > 1 or dims.cp > 1):
        problems.append("training.document_mask is not supported with pipeline or context parallel yet")
    return problems


def _tp_problems(dims: ParallelDims, model: ModelShape, options: ParallelOptions, device_type: str
                 ) -> list[str]:
    tp, cp, out = dims.tp, dims.cp, []
    if options.async_tp:
        if tp == 1:
            out.append("parallelism.enable_async_tensor_parallel needs tensor_parallel_degree > 1")
        elif device_type != "cuda":
            out.append("parallelism.enable_async_tensor_parallel needs CUDA GPUs (symmetric memory); "
                       "it is not available on CPU")
        elif not options.compile:
            out.append("parallelism.enable_async_tensor_parallel needs --compile.enable (the overlap is "
                       "done by inductor)")
    if tp == 1:
        return out
    if model.n_heads % tp:
        out.append(f"tensor_parallel_degree {tp} must divide the model's {model.n_heads} attention heads")
    if model.n_kv_heads % tp:
        out.append(f"tensor_parallel_degree {tp} must divide the model's {model.n_kv_heads} key/value heads "
                   "(GQA with fewer KV heads than TP ranks is not supported)")
    if model.vocab_size is not None and model.vocab_size % tp:
        out.append(f"tensor_parallel_degree {tp} must divide the vocabulary size {model.vocab_size} (the "
                   "embedding and output head are split over it)")
    if options.seq_len % (tp * cp):
        out.append(f"training.seq_len {options.seq_len} must be divisible by tensor_parallel_degree {tp}"
                   + (f" × context_parallel_degree {cp}" if cp > 1 else "")
                   + " (sequence parallel shards each rank's sequence)")
    if model.tied_embeddings:
        flavor = (f"--model.flavor {' or '.join(model.untied_flavors)}" if model.untied_flavors
                  else "a flavor whose args set tie_embeddings=False")
        out.append("tensor parallel does not support tied embeddings (the embedding is split by rows, "
                   f"the output head by columns): use a flavor with its own output head ({flavor}), "
                   "or shard the tied model with FSDP alone (--parallelism.tensor_parallel_degree 1)")
    return out


def _cp_problems(dims: ParallelDims, options: ParallelOptions) -> list[str]:
    cp, out = dims.cp, []
    if cp > 1 and options.seq_len % (2 * cp):
        out.append(f"training.seq_len {options.seq_len} must be divisible by 2 × context_parallel_degree = "
                   f"{2 * cp} (load-balanced causal sharding)")
    return out


def _ep_problems(dims: ParallelDims, model: ModelShape) -> list[str]:
    ep = dims.ep
    if ep == 1:
        return []
    if model.num_experts is None:
        return [f"expert_parallel_degree {ep} needs a Mixture-of-Experts model (e.g. --model.name moe); "
                "this model is dense"]
    if model.num_experts % ep:
        return [f"expert_parallel_degree {ep} must divide num_experts {model.num_experts}"]
    return []


def _pp_problems(dims: ParallelDims, model: ModelShape, options: ParallelOptions,
                 global_batch: int | None) -> list[str]:
    pp, out = dims.pp, []
    if pp > model.n_layers:
        out.append(f"pipeline_parallel_degree {pp} is more than the model's {model.n_layers} layers")
    if pp == 1:
        return out
    if not model.can_pipeline:
        out.append(f"pipeline_parallel_degree {pp} needs a model that can be cut into stages; this "
                   "model's ModelSpec has no pipeline_fn")
    try:
        stage_layers(model.n_layers, pp, options)
    except KilnError as e:
        out.append(str(e))
    if global_batch is not None:
        out += _microbatch_problems(global_batch // dims.dp, pp, options)
    if dims.ep > 1 and options.ac_mode == "selective" and options.ac_option == "op":
        # torch's selective checkpoint replays a block's ops in backward and requires the same ones; with
        # the experts FSDP-wrapped inside the block and kept gathered across microbatches, it meets
        # FSDP's profiler ops it did not record and fails in the first backward
        out.append("per-op selective activation checkpointing (selective_ac_option 'op') cannot run expert "
                   "parallel under pipeline parallel: its backward replay fails on the experts' FSDP; use "
                   "selective_ac_option N (every N-th block) or activation_checkpoint.mode full")
    return out


def _batch_problems(dims: ParallelDims, global_batch: int | None, local_batch: int | None) -> list[str]:
    """A step's global batch must split into whole local batches on every data-parallel rank."""
    if global_batch is None or local_batch is None or global_batch % (local_batch * dims.dp) == 0:
        return []
    return [f"training.global_batch_size {global_batch} must be divisible by local_batch_size {local_batch} "
            f"× data-parallel degree {dims.dp} = {local_batch * dims.dp}"]


def _microbatch_problems(rows: int, pp: int, options: ParallelOptions) -> list[str]:
    """A step's rows per rank must split into microbatches, enough of them for the schedule."""
    size = options.pp_microbatch_size
    if rows % size:
        return [f"the rows per rank and step ({rows} = global_batch_size / dp) are not divisible by "
                f"parallelism.pipeline_parallel_microbatch_size {size}"]
    # GPipe and LoopedBFS run every forward, then every backward: any count of microbatches will do
    if options.pp_schedule not in ("GPipe", "LoopedBFS") and rows // size < pp:
        return [f"schedule {options.pp_schedule} needs at least as many microbatches as pipeline ranks "
                f"({pp}); a step gives {rows // size} ({rows} rows / microbatch size {size})"]
    return []


def stage_layers(n_layers: int, pp: int, options: ParallelOptions) -> list[list[int]]:
    """The layers of every pipeline stage (pp × stages per rank of the schedule), as options ask."""
    num_stages = pp * stages_per_rank(options.pp_schedule)
    if options.pp_stage_layers:
        return parse_stage_layers(options.pp_stage_layers, n_layers, num_stages)
    return split_layers(n_layers, num_stages, options.pp_layers_per_stage)
