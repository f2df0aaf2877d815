"""A weight that the first and the last pipeline stage share (tied input and output embeddings).

Under pipeline parallel the first stage holds the embedding and the last stage the output head;
when a model ties them, each of the two stages has its own copy. Kiln keeps the copies one weight
as Megatron-LM does: they start equal (the layout-free init seeds a parameter by its first name),
their gradients are summed after every backward, so each copy holds the tied weight's whole
gradient, and identical optimizer steps keep them equal. The grad norm counts the weight once.
"""

import torch
import torch.distributed as dist
from torch import nn

from components.runtime.tensor_utils import local_tensor
from parallelisms.materialize import canonical_name
from parallelisms.parallel_dims import ParallelDims
from parallelisms.pipeline import stage_ids


def shared_parameter_names(model: nn.Module) -> list[list[str]]:
    """The names of every parameter the model uses under more than one name (tied weights)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


class TiedWeightSync:
    """Sums the gradients of each tied weight's copies on the first and the last pipeline stage."""

    def __init__(self, parts: list[nn.Module], ids: list[int], tied: list[list[str]], dims: ParallelDims,
                 schedule: str, num_stages: int) -> None:
        named = [(i, canonical_name(n), p) for part, i in zip(parts, ids, strict=True)
                 for n, p in part.named_parameters()]
        # Per tied weight, this rank's copies of it (none on a middle stage).
        self.copies = [[p for _, n, p in named if n in names] for names in tied]
        # The copies on stages other than the first: the grad norm counts each weight once.
        self.second_copies = [p for i, n, p in named if i != 0 and any(n in names for names in tied)]
        self.group = self._pair_group(dims, schedule, num_stages)

    @staticmethod
    def _pair_group(dims: ParallelDims, schedule: str, num_stages: int) -> dist.ProcessGroup | None:
        """The group of the two ranks holding the first and the last stage, for each coordinate of
        the other mesh dimensions; None when one rank holds both (the "v" schedules)."""
        last_owner = next(r for r in range(dims.pp) if num_stages - 1 in stage_ids(r, dims.pp, schedule))
        if last_owner == 0:
            return None
        # pp is the outermost mesh dimension: stage-rank s, coordinate c of the rest is s × per + c
        # (arithmetic, not the mesh tensor: the planner builds this under FakeTensorMode).
        per = dims.world_size // dims.pp
        mine = None
        for column in range(per):  # every rank creates every group, in the same order
            pair = [column, last_owner * per + column]
            group = dist.new_group(pair)
            if dist.get_rank() in pair:
                mine = group
        return mine

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """After backward: every copy holds the sum of its weight's copies' gradients."""
        for copies in self.copies:
            grads = [local_tensor(p.grad) for p in copies if p.grad is not None]
            if len(grads) > 1:  # both stages on this rank (a "v" schedule)
                total = torch.stack(grads).sum(0)
                for g in grads:
                    g.copy_(total)
            elif grads and self.group is not None:
                dist.all_reduce(grads[0], group=self.group)
