"""One training step of this rank — microbatches or pipeline schedule, clip, optimizer — shared by
the trainer (train.py) and the planner, which runs it on fake tensors to measure a rank; and the
loss, the evaluation forward validation runs, and the means over the ranks that hold a step's tokens.

Built from this rank's model parts by training.assembly.build_train_step(); what depends on the
values of the data (how many tokens a step has, how many reached each expert) sits in two
methods the planner replaces, `count_tokens` and `balance_experts`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from components.config.parallel_options import ParallelOptions
from components.optim.expert_balance import balance_experts, moe_layers, reset_expert_load, set_aux_loss_scale
from components.optim.grad_norm import clip_grad_norm
from components.runtime.tensor_utils import local_tensor
from models.common.mtp import next_tokens_of
from parallelisms.context_parallel import head_tail_positions, shard_sequence
from parallelisms.fsdp import set_gradient_sync
from parallelisms.parallel_dims import ParallelDims
from parallelisms.partial_gradients import reduce_partial_gradients
from parallelisms.pipeline import PipelineRunner, StageShapes, build_stages
from parallelisms.tensor_parallel import loss_context
from parallelisms.tied_weights import TiedWeightSync

if TYPE_CHECKING:
    from components.fault_tolerance.replica_groups import ReplicaGroups
    from training.assembly import ModelParts

Batch = list[tuple[torch.Tensor, torch.Tensor]]  # a step's microbatches of (inputs, labels)
# A microbatch as the step runs it: inputs, labels, and with multi-token prediction the next tokens
# (models/common/mtp.py), each this rank's share of the sequence.
Microbatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
IGNORE_INDEX = -100  # a label that counts nothing (no loss, no token)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy (fp32 logits; labels equal to IGNORE_INDEX count nothing), so
    the step can normalise by the global token count."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1),
                           reduction="sum", ignore_index=IGNORE_INDEX)


def cross_entropy_rows(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-row sums of token cross-entropy [batch] (fp32; IGNORE_INDEX counts nothing): the loss of
    each row, for the loss of each source of a mixture."""
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="none",
                                ignore_index=IGNORE_INDEX)
    return per_token.view(labels.shape).sum(1)


@dataclass
class StepSetup:
    """What a step needs besides the model parts and optimizers."""

    dims: ParallelDims
    options: ParallelOptions
    device: torch.device
    max_norm: float
    global_batch: int
    after_optimizer_step: Callable[[], None] | None = None  # the model converters' hook (float8 scales)
    mtp_loss_weight: float = 0.3  # of the multi-token prediction loss, the mean over its depths


class TrainStep:
    """Forward/backward over a step's microbatches (or the pipeline schedule), the distributed
    grad-norm clip, the optimizer and LR step; call it with the step's microbatches."""

    def __init__(self, model: ModelParts, optimizers: list[torch.optim.Optimizer], schedulers: list,
                 setup: StepSetup, stage_shapes: StageShapes | None = None) -> None:
        dims, options, parts = setup.dims, setup.options, model.parts
        self.parts, self.optimizers, self.schedulers = parts, optimizers, schedulers
        self.dims, self.device, self.max_norm = dims, setup.device, setup.max_norm
        self.after_optimizer_step = setup.after_optimizer_step
        # Ranks that hold different tokens of a step (data and context parallel): losses and token
        # counts are summed over them.
        loss_mesh, cp_mesh = dims.mesh("dp_cp"), dims.mesh("cp")
        self.loss_group = loss_mesh.get_group() if loss_mesh is not None else None
        # Under context parallel each rank keeps its head-tail share of every sequence.
        self.cp_positions = (head_tail_positions(options.seq_len, dims.cp, cp_mesh.get_local_rank())
                             if cp_mesh is not None else None)
        # Under TP the logits stay sharded over the vocabulary into the loss, unless disabled.
        self.loss_parallel = dims.tp > 1 and options.loss_parallel
        # The loss is compiled with the blocks, except on vocabulary-sharded DTensor logits.
        compile_loss = options.compile and not self.loss_parallel
        self.loss_fn: Callable = torch.compile(cross_entropy_sum) if compile_loss else cross_entropy_sum
        self.rows_fn: Callable = torch.compile(cross_entropy_rows) if compile_loss else cross_entropy_rows
        # With per_row_losses set (a mixture's per-source metrics), each microbatch's loss is summed
        # from its rows' losses, kept (with the rows' token counts) in row order for row_sums().
        self.per_row_losses = False
        self.row_losses: list[torch.Tensor] = []
        self.row_tokens: list[torch.Tensor] = []
        # MoE layers (if any): their expert load moves the expert bias after each step.
        self.moe_layers = moe_layers(parts)
        self.expert_load: dict[str, list[int]] = {}
        # Multi-token prediction: the model's modules leave their summed loss on the last stage's
        # part; each depth's sum gets weight / depth, and this step's sum and tokens are kept to log.
        self.mtp_depth = model.mtp_depth
        self.mtp_weight = setup.mtp_loss_weight / max(model.mtp_depth, 1)
        last_parts = [p for p, i in zip(parts, model.stage_ids, strict=True) if i == model.num_stages - 1]
        self.mtp_part = last_parts[0] if self.mtp_depth and last_parts else None
        self.mtp_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.mtp_count = torch.zeros((), dtype=torch.float64, device=self.device)
        self.pipeline = (self._build_pipeline(model, setup, stage_shapes) if dims.pp > 1 else None)
        # A tied embedding cut into two stages' copies stays one weight (parallelisms/tied_weights.py).
        # Fault tolerance (components/fault_tolerance): this group among the live replica groups.
        self.replicas: ReplicaGroups | None = None
        self.committed = True  # whether the last step's optimizer step ran
        self.tied = (TiedWeightSync(parts, model.stage_ids, model.tied_names, dims, options.pp_schedule,
                                    model.num_stages) if model.tied_names and dims.pp > 1 else None)

    def _build_pipeline(self, model: ModelParts, setup: StepSetup, shapes: StageShapes | None
                        ) -> PipelineRunner:
        """The schedule over this rank's stages; a step's rows per rank split into microbatches."""
        n_microbatches = setup.global_batch // self.dims.dp // setup.options.pp_microbatch_size
        stages = build_stages(self.parts, model.stage_ids, model.num_stages, self.device,
                              self.dims.mesh("pp"), self._after_shape_inference, shapes)
        return PipelineRunner(setup.options.pp_schedule, stages, n_microbatches, self._loss_with_mtp,
                              model.num_stages)

    def _after_shape_inference(self) -> None:
        """Undo what the pipeline's shape-inference pass left: expert load counts, an MTP loss and
        its count in this step's sums."""
        reset_expert_load(self.moe_layers)
        if self.mtp_part is not None:
            self.mtp_part.mtp_loss = None
        self.mtp_sum.zero_()
        self.mtp_count.zero_()
        self.row_losses, self.row_tokens = [], []

    def _loss_with_mtp(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy, plus the weighted MTP loss the forward just left (if any)."""
        return self._main_loss(logits, labels) + self._take_mtp_loss()

    def _main_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy of a microbatch (from its rows' losses, kept, when per_row_losses)."""
        if not self.per_row_losses:
            return self.loss_fn(logits, labels)
        rows = self.rows_fn(logits, labels)
        self.row_losses.append(local_tensor(rows.detach()).double())
        self.row_tokens.append((labels != IGNORE_INDEX).sum(1).double())
        return rows.sum()

    def row_sums(self, groups: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's summed loss and labelled tokens per group of rows ([n_groups] each, summed over
        the ranks that hold the step's tokens, from the last pipeline stage); groups: the group of
        each of this rank's rows, in the order the step ran them. Every rank must call it."""
        both = torch.zeros(2, n_groups, dtype=torch.float64, device=self.device)
        if self.row_losses:
            ids = groups.to(self.device)
            both[0].index_add_(0, ids, torch.cat(self.row_losses))
            both[1].index_add_(0, ids, torch.cat(self.row_tokens))
        if self.loss_group is not None:
            dist.all_reduce(both, group=self.loss_group)
        if self.pipeline is not None:
            both = both if self.pipeline.has_last else torch.zeros_like(both)
            dist.all_reduce(both, group=self.dims.mesh("pp").get_group())
        return both[0], both[1]

    def _take_mtp_loss(self) -> torch.Tensor | float:
        """The weighted MTP loss of the last forward (0 without one), counted for the step's log."""
        loss = self.mtp_part.mtp_loss if self.mtp_part is not None else None
        if loss is None:
            return 0.0
        self.mtp_part.mtp_loss = None
        self.mtp_sum += local_tensor(loss.detach()).double()
        self.mtp_count += local_tensor(self.mtp_part.mtp_tokens).double()
        return self.mtp_weight * loss

    def __call__(self, microbatches: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns this rank's summed loss and token count, and the global grad norm."""
        self.mtp_sum.zero_()
        self.mtp_count.zero_()
        self.row_losses, self.row_tokens = [], []
        step = [self.shard_sequence(x, y, next_tokens_of(y, self.mtp_depth) if self.mtp_depth else None)
                for x, y in microbatches]
        local_tokens, global_tokens = self.count_tokens([(x, y) for x, y, _ in step])
        live = 1
        if self._per_step_replicas():
            global_tokens, live = self.replicas.exchange(global_tokens)
        # Every rank's loss is a sum over its tokens scaled by dp·cp / global tokens: the gradient
        # average over data- and context-parallel ranks (÷ dp·cp) then yields the gradient of the
        # mean over the global batch (and so does the average over the live replica groups, ÷ live).
        scale = self.dims.dp * self.dims.cp * live / global_tokens
        set_aux_loss_scale(self.moe_layers, scale)
        if self.pipeline is not None:
            loss_sum = self._pipeline_forward_backward(step, scale)
        else:
            loss_sum = self._forward_backward(step, scale)
        return loss_sum, local_tokens, self._optimizer_step()

    def count_tokens(self, microbatches: Batch) -> tuple[torch.Tensor, float]:
        """This rank's labelled tokens (a tensor) and the step's, summed over the loss group."""
        local = torch.tensor(sum(int((y != IGNORE_INDEX).sum()) for _, y in microbatches),
                             dtype=torch.float64, device=self.device)
        total = local.clone()
        if self.loss_group is not None:
            dist.all_reduce(total, group=self.loss_group)
        return local, total.item()

    def _forward_backward(self, microbatches: list[Microbatch], scale: float) -> torch.Tensor:
        """Gradient accumulation over the microbatches; data-parallel sync on the last one only."""
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for i, microbatch in enumerate(microbatches):
            loss_sum += self._microbatch(microbatch, scale, last=i == len(microbatches) - 1)
        return loss_sum

    def _microbatch(self, microbatch: Microbatch, scale: float, last: bool) -> torch.Tensor:
        """Forward and backward of one microbatch; returns its summed (main) loss."""
        model = self.parts[0]
        set_gradient_sync(model, last)
        inputs, labels, next_tokens = (t.to(self.device) if t is not None else None for t in microbatch)
        kwargs = {"next_tokens": next_tokens} if next_tokens is not None else {}
        with loss_context(self.loss_parallel):
            loss = self._main_loss(model(inputs, **kwargs), labels)
            ((loss + self._take_mtp_loss()) * scale).backward()
        return local_tensor(loss.detach())

    def _pipeline_forward_backward(self, microbatches: list[Microbatch], scale: float) -> torch.Tensor:
        """The whole step's rows through the pipeline schedule (it cuts its own microbatches)."""
        inputs, labels = (torch.cat([m[i] for m in microbatches]).to(self.device) for i in (0, 1))
        kwargs = ({"next_tokens": torch.cat([m[2] for m in microbatches]).to(self.device)}
                  if self.mtp_depth else {})
        with loss_context(self.loss_parallel):
            total = self.pipeline.run(inputs, labels, scale, **kwargs)
        return total - self.mtp_weight * self.mtp_sum.float()  # the main loss alone

    def _optimizer_step(self) -> torch.Tensor:
        """Clip by the global grad norm (across meshes and stages), step, move the MoE expert bias
        from the global load, step the LR, clear gradients; returns the grad norm."""
        if self.tied is not None:
            self.tied.sum_gradients()
        params = [p for part in self.parts for p in part.parameters()]
        if self.replicas is not None and self.replicas.reduce_after_backward:
            self.replicas.reduce_gradients(params)
        reduce_partial_gradients(params)  # sequence-parallel norm weights: once, not per reader
        pp_mesh = self.dims.mesh("pp")
        pp_group = pp_mesh.get_group() if pp_mesh is not None else None
        grad_norm = clip_grad_norm(params, self.max_norm, pp_group,
                                   counted_elsewhere=self.tied.second_copies if self.tied is not None else [])
        self.committed = not self._per_step_replicas() or self.replicas.commit()
        if not self.committed:  # a replica group failed during the step: it is run again
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            return grad_norm
        for opt in self.optimizers:
            opt.step()
        if self.after_optimizer_step is not None:
            self.after_optimizer_step()
        self.expert_load = self.balance_experts()
        for sched in self.schedulers:
            sched.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return grad_norm

    def balance_experts(self) -> dict[str, list[int]]:
        """Move every MoE layer's expert bias from this step's global load; returns the load."""
        across = self.replicas.sum_across if self._per_step_replicas() else None
        return balance_experts(self.moe_layers, self.loss_group, across)

    def _per_step_replicas(self) -> bool:
        """Whether gradients (and so token counts and expert loads) are averaged across replica groups
        every step."""
        return self.replicas is not None and self.replicas.per_step

    def shard_sequence(self, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """This rank's share of the sequences (dimension 1) under context parallel (all of them
        otherwise); None stays None."""
        if self.cp_positions is None:
            return tensors
        return tuple(shard_sequence(t, self.cp_positions) if t is not None else None for t in tensors)

    @torch.no_grad()
    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], local_batch: int
                 ) -> tuple[float, int]:
        """The mean loss over evaluation batches (each a whole step's rows of this rank, cut into
        local_batch rows per forward, or the pipeline's microbatches) and the tokens it averaged."""
        for part in self.parts:
            part.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = torch.zeros((), dtype=torch.float64, device=self.device)
        for inputs, labels in batches:
            inputs, labels = self.shard_sequence(inputs, labels)
            inputs, labels = inputs.to(self.device), labels.to(self.device)
            with loss_context(self.loss_parallel):
                if self.pipeline is not None:
                    total += self.pipeline.run(inputs, labels, 1.0, train=False).double()
                else:
                    for x, y in zip(inputs.split(local_batch), labels.split(local_batch), strict=True):
                        total += local_tensor(self.loss_fn(self.parts[0](x), y)).double()
            count += (labels != IGNORE_INDEX).sum()
        for part in self.parts:
            part.train()
        return self.global_mean(total, count)

    def global_mean(self, total: torch.Tensor, count: torch.Tensor) -> tuple[float, int]:
        """(sum(total) / sum(count), sum(count)) over the data- and context-parallel ranks (and from
        the last pipeline stage, which alone has the loss): the mean and the tokens it averaged."""
        both = torch.stack([total.double(), count.double()])
        if self.loss_group is not None:
            dist.all_reduce(both, group=self.loss_group)
        if self.pipeline is not None:
            both = both if self.pipeline.has_last else torch.zeros_like(both)
            dist.all_reduce(both, group=self.dims.mesh("pp").get_group())
        if self._per_step_replicas():
            both = self.replicas.sum_across(both)
        return (both[0] / both[1]).item(), int(both[1].item())

    def expert_load_of_all_stages(self) -> dict[str, list[int]]:
        """This step's tokens per expert of every MoE layer, gathered along the pipeline; every rank
        must call it (under PP it is a collective)."""
        load = self.expert_load
        if self.pipeline is not None:
            stages: list[dict] = [{} for _ in range(self.dims.pp)]
            dist.all_gather_object(stages, load, group=self.dims.mesh("pp").get_group())
            load = {k: v for stage in stages for k, v in stage.items()}
        return dict(sorted(load.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0))

    @property
    def pipeline_microbatches(self) -> int:
        """Microbatches per step of the pipeline schedule (0 without PP)."""
        return self.pipeline.n_microbatches if self.pipeline is not None else 0
