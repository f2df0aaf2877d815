"""Context parallel: the sequence split over cp ranks, attention still over the whole sequence.

Sharding is load-balanced for causal attention ("head-tail"): the sequence is cut into 2·cp
chunks and rank i keeps chunks i and 2·cp−1−i, so every rank has the same amount of unmasked
attention work. Inputs, labels and RoPE positions are sharded the same way; the model then runs
on S/cp tokens per rank and only attention talks to the other ranks, in one of two ways:
- `allgather`: gather every rank's K and V (funcol's all-gather, autograd through it), then attend
  (with --comm.gloo_accelerations on gloo: broadcasts in flight while the rank attends its own
  chunks, parallelisms/gloo_accelerations.py);
- `ring`: pass K/V chunks around the ring (send/recv), so a rank never holds more than two
  ranks' K/V.
Either way attention runs one chunk pair at a time, merging by log-sum-exp and skipping pairs
the causal mask hides (parallelisms/blockwise_attention.py).

Kiln's own implementation on every device: torch's `context_parallel` fails on CPU
(docs/compatibility.md) and shards buffers with its own layout, which would tie Kiln's data and
RoPE positions to a private API.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_gather_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from components.runtime.errors import KilnError
from components.runtime.tensor_utils import outside_compile
from parallelisms.blockwise_attention import gathered_attention, ring_attention

ROTATE_METHODS = ("allgather", "ring")


def head_tail_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The sequence positions this cp rank keeps: chunk `rank` then chunk `2·cp−1−rank`."""
    if seq_len % (2 * cp) != 0:
        raise KilnError(f"seq_len {seq_len} is not divisible by 2 × cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                      torch.arange(second * chunk, (second + 1) * chunk)])


def shard_sequence(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """This rank's tokens of a [batch, seq, ...] tensor."""
    return t.index_select(1, positions.to(t.device))


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        group: dist.ProcessGroup) -> torch.Tensor:
    """Causal attention of local queries over the keys/values of every cp rank.

    q [b, heads, s_local, d], k/v [b, kv_heads, s_local, d]; K and V are gathered along the
    sequence in rank order by funcol's all-gather, with autograd: the backward reduce-scatters their
    gradients home.
    """
    kv = torch.stack([k, v]).movedim(3, 0).contiguous()  # [s_local, 2, b, kv_heads, d]: gather on dim 0
    gathered = all_gather_single_autograd(kv, gather_dim=0, group=group)
    # The copy into [2, b, kv_heads, seq, d] waits for the gather: a funcol result is an
    # AsyncCollectiveTensor, whose every later slice (views keep the wrapper) would go through its
    # Python dispatch, in forward and in backward.
    k_all, v_all = gathered.movedim(0, 3).contiguous()
    return gathered_attention(q, k_all, v_all, dist.get_rank(group), dist.get_world_size(group))


class ContextParallelAttention:
    """The core-attention callable that apply_cp installs in every attention module."""

    def __init__(self, cp_mesh: DeviceMesh, seq_len: int, rotate_method: str) -> None:
        if rotate_method not in ROTATE_METHODS:
            raise KilnError(f"context_parallel_rotate_method must be one of {', '.join(ROTATE_METHODS)}, "
                             f"got {rotate_method!r}")
        self.group = cp_mesh.get_group()
        self.cp, self.rank = cp_mesh.size(), cp_mesh.get_local_rank()
        self.method = rotate_method
        self.positions = head_tail_positions(seq_len, self.cp, self.rank)
        # (q, k, v, group) → output; gloo_accelerations may swap in its overlapped gather
        self.attend: Callable = allgather_attention if rotate_method == "allgather" else ring_attention

    @outside_compile  # point-to-point and gathers stay outside compiled graphs
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attend(q, k, v, self.group)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, seq_len: int, rotate_method: str) -> None:
    """Make the model run on this rank's head-tail share of the sequence.

    The model's RoPE table is read at this rank's positions (`rope_positions`), and every module
    with a `core_attention` attribute gets the context-parallel attention.
    """
    attention = [m for m in model.modules() if hasattr(m, "core_attention")]
    if not attention or not hasattr(model, "rope_positions"):
        raise KilnError("context parallel needs the model's hooks `rope_positions` and `core_attention` "
                        "on its attention modules (models/protocol.py); this model lacks them")
    core: Callable = ContextParallelAttention(cp_mesh, seq_len, rotate_method)
    model.rope_positions = core.positions
    for module in attention:
        module.core_attention = core
