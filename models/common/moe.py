"""Mixture-of-Experts feed-forward: a top-k router, stacked SwiGLU experts, optional shared experts.

Dropless token choice: every token reaches its k experts (no capacity factor), so the result does
not depend on how tokens are spread over ranks. Expert weights are stacked [experts, ...] tensors,
so expert parallel can split them along the first dimension. Load balancing is the auxiliary-
loss-free expert bias (DeepSeek-V3): the bias steers which experts are chosen, never the weights
they get, and the trainer moves it after each step from the global expert load
(`update_expert_bias`); an auxiliary loss is optional.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from components.runtime.tensor_utils import local_tensor, outside_compile
from models.common.feed_forward import FeedForward
from models.common.init import trunc_normal_


@dataclass
class MoEArgs:
    """Shape and routing of an MoE layer."""

    num_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 512  # of one routed expert
    num_shared_experts: int = 0  # shared experts form one SwiGLU of num_shared × hidden_dim
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    route_norm: bool = False  # renormalise the k chosen scores to sum 1
    route_scale: float = 1.0
    load_balance_coeff: float | None = 1e-3  # expert-bias step per update; None = no bias
    aux_loss_coeff: float = 0.0  # weight of the load-balancing auxiliary loss; 0 = off
    # Group-limited routing (DeepSeek-V3): the experts form num_groups equal groups, each token keeps
    # the top_k_groups groups whose two best (bias-adjusted) scores sum highest and chooses its
    # top_k experts inside them. 1 group = plain top-k.
    num_groups: int = 1
    top_k_groups: int = 1


class TopKRouter(nn.Module):
    """Scores every expert for every token and picks the top k."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        self.args = args

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, dim] → (weights [tokens, k] fp32, experts [tokens, k], scores [tokens, experts])."""
        a = self.args
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if a.score_func == "softmax" else logits.sigmoid()
        choice = scores if expert_bias is None else scores + expert_bias
        if a.num_groups > 1:
            choice = self._limit_to_groups(choice)
        experts = choice.topk(a.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if a.route_norm:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * a.route_scale, experts, scores

    def _limit_to_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [tokens, experts] with the experts outside each token's top_k_groups groups set to
        -inf; a group ranks by the sum of its two best scores (its only one, for groups of one)."""
        a = self.args
        grouped = choice.unflatten(-1, (a.num_groups, -1))  # [tokens, groups, experts per group]
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = group_scores.topk(a.top_k_groups, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        return grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).flatten(1)


class GroupedExperts(nn.Module):
    """num_experts SwiGLU experts as stacked weights w1/w3 [E, hidden, dim] and w2 [E, dim, hidden]."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    # Left out of torch.compile: the split sizes change every step (a recompile each time), and the
    # stacked weights may be DTensors whose local pieces are taken here.
    @outside_compile
    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [tokens, dim] sorted by expert, counts[e] rows for local expert e → outputs, same order."""
        if x.is_cuda and self.grouped_mm_takes(x):
            return self.grouped_mm(x, counts)
        return self.loop(x, counts)

    @staticmethod
    def compute_dtype(x: torch.Tensor) -> torch.dtype:
        """The dtype a matmul of x computes in: autocast's where it is on for x's device (layouts that
        FSDP does not cast: x arrives in float32), else x's own."""
        device = x.device.type
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype

    @staticmethod
    def grouped_mm_takes(x: torch.Tensor) -> bool:
        """Whether torch._grouped_mm takes these inputs on CUDA: bfloat16 compute, in a torch that has
        it. Its backward fails on CPU (docs/compatibility.md), so CPU takes the loop."""
        return GroupedExperts.compute_dtype(x) == torch.bfloat16 and hasattr(torch, "_grouped_mm")

    def grouped_mm(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """One grouped GEMM per projection, in the compute dtype: autocast leaves torch._grouped_mm's
        inputs as they are (float32 in, float32 out on torch 2.14's CPU; CUDA's kernel takes bfloat16
        only), so they are cast here as autocast casts a matmul's."""
        dtype = self.compute_dtype(x)
        w1, w2, w3 = (local_tensor(w).to(dtype) for w in (self.w1, self.w2, self.w3))
        x = x.to(dtype)
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)

    def loop(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Three matmuls per expert, one expert after another."""
        w1, w2, w3 = local_tensor(self.w1), local_tensor(self.w2), local_tensor(self.w3)
        outs = []
        for e, xs in enumerate(torch.split(x, counts)):
            h = F.silu(xs @ w1[e].T) * (xs @ w3[e].T)
            outs.append(h @ w2[e].T)
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])

    def init_weights(self, std_out: float) -> None:
        trunc_normal_(self.w1, mean=0.0, std=0.02)
        trunc_normal_(self.w3, mean=0.0, std=0.02)
        trunc_normal_(self.w2, mean=0.0, std=std_out)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def local_experts(x: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
    """Run tokens sorted by expert through this rank's experts (all of them without expert parallel)."""
    return experts(x, counts.tolist())


class _AuxLossGradient(torch.autograd.Function):
    """Identity on the layer output whose backward also sends `scale` into the auxiliary loss, so the
    loss joins the gradient without changing what the model returns (it works across pipeline stages)."""

    @staticmethod
    def forward(ctx, out, aux, scale):  # noqa: ANN001, ANN205
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad, torch.full(ctx.aux_shape, ctx.scale, device=grad.device), None


class MoE(nn.Module):
    """Routed experts (+ shared experts) in place of a block's feed-forward."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.router = TopKRouter(dim, args)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.num_experts)
        self.shared_experts = (FeedForward(dim, args.hidden_dim * args.num_shared_experts)
                               if args.num_shared_experts > 0 else None)
        # The bias is training state (saved in checkpoints); the load is counted between updates.
        self.register_buffer("expert_bias", torch.zeros(args.num_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        # Expert parallel replaces this with dispatch → local experts → combine over its ranks.
        self.dispatch: Callable[[torch.Tensor, torch.Tensor, GroupedExperts], torch.Tensor] = local_experts
        # The trainer sets this to the factor it gives the summed token loss (see train_step).
        self.aux_loss_scale = 1.0
        # Tensor parallel splits every expert's hidden units, so the gradients reaching the routing
        # weights and the experts' input are partial sums; TP sets this to sum them in backward.
        self.partial_grad_sync: Callable[[torch.Tensor], torch.Tensor] = _identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        a = self.args
        bias = self.expert_bias if a.load_balance_coeff is not None else None
        weights, experts, scores = self.router(x, bias)
        # Tokens per expert; a scatter-add rather than bincount keeps the shape static (fake tensors
        # and compiled graphs know it without the data).
        chosen = experts.flatten()
        counts = torch.zeros(a.num_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, chosen, torch.ones_like(chosen))
        # Count real training forwards once: not the no-grad shape inference of pipeline stages,
        # nor activation checkpointing's re-run of forward inside backward.
        if self.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            self.tokens_per_expert += counts.detach().to(self.tokens_per_expert.dtype)
        weights = self.partial_grad_sync(weights)
        order = experts.flatten().argsort(stable=True)  # (token, choice) pairs grouped by expert
        token_of = order // a.top_k
        # Summed before the copies per choice: one row a token rather than top_k of them.
        routed = self.dispatch(self.partial_grad_sync(x)[token_of], counts, self.experts)
        routed = routed * weights.flatten()[order].unsqueeze(-1).to(routed.dtype)
        out = torch.zeros_like(x).index_add_(0, token_of, routed.to(x.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if a.aux_loss_coeff > 0 and self.training:
            out = _AuxLossGradient.apply(out, self.aux_loss(scores, counts), self.aux_loss_scale)
        return out.reshape(shape)

    def aux_loss(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Switch-style balance loss, summed over this batch's tokens like the token loss:
        coeff · tokens · E · Σ_e (share of choices for e) · (mean probability of e)."""
        a = self.args
        tokens = scores.shape[0]
        probs = scores / scores.sum(-1, keepdim=True)
        share = counts.float() / (tokens * a.top_k)
        return a.aux_loss_coeff * tokens * a.num_experts * (share * probs.mean(0)).sum()

    @torch.no_grad()
    def update_expert_bias(self, global_counts: torch.Tensor) -> None:
        """Raise the bias of under-loaded experts and lower it for over-loaded ones, then reset the count."""
        if self.args.load_balance_coeff is not None:
            mean = global_counts.float().mean()
            self.expert_bias += self.args.load_balance_coeff * torch.sign(mean - global_counts.float())
        self.tokens_per_expert.zero_()

    def init_weights(self, std_out: float) -> None:
        trunc_normal_(self.router.gate.weight, mean=0.0, std=0.02)
        self.experts.init_weights(std_out)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(std_out)

    def init_buffers(self) -> None:
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()
