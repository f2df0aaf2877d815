"""Semi-synchronous training across replica groups: DiLoCo, as torchft implements it.

Each group takes `sync_every` steps with its own (inner) optimizer and no traffic between groups;
then the groups average their pseudo-gradients (weights at the last sync minus weights now) and an
outer SGD step with Nesterov momentum moves every group to the same new weights. A group that
failed during the interval is left out of that average; one that joins heals at a sync point.
"""

import contextlib

import torch
from torch import nn

from components.config.sections import FaultTolerance
from components.runtime.errors import KilnError


def diloco(manager: object, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
           ft: FaultTolerance) -> contextlib.AbstractContextManager:
    """torchft's DiLoCo over this rank's model part: enter it around the training loop (it hooks the
    inner optimizer's step). Built after any resume, since it keeps the weights it starts from."""
    from torchft.local_sgd import DiLoCo

    if len(parts) != 1 or len(optimizers) != 1:
        raise KilnError("fault_tolerance.semi_sync = 'diloco' needs one model part per rank (a pipeline "
                        "schedule with several stages per rank has several)")
    params = [p for p in parts[0].parameters() if p.requires_grad]
    outer = torch.optim.SGD(params, lr=ft.outer_lr, momentum=ft.outer_momentum, nesterov=True)
    return DiLoCo(manager, [parts[0]], optimizers[0], outer, sync_every=ft.sync_every)
