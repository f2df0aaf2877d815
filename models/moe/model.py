"""A Llama-style transformer whose feed-forward is a Mixture of Experts (after optional dense layers)."""

from dataclasses import dataclass, field

import torch
from torch import nn

from models.common.moe import MoE, MoEArgs
from models.llama3.model import LlamaArgs, Transformer, TransformerBlock, llama_flops_per_token


@dataclass
class MoEModelArgs(LlamaArgs):
    """Llama shape plus the MoE layer; the first n_dense_layers blocks keep a dense SwiGLU."""

    moe: MoEArgs = field(default_factory=MoEArgs)
    n_dense_layers: int = 0


class MoEBlock(TransformerBlock):
    """Pre-norm block with attention and either a dense feed-forward or an MoE layer (`moe`)."""

    def __init__(self, layer_id: int, args: MoEModelArgs) -> None:
        super().__init__(layer_id, args)
        self.moe_enabled = layer_id >= args.n_dense_layers
        if self.moe_enabled:
            del self.feed_forward
            self.moe = MoE(args.dim, args.moe)

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, doc_ids)
        return h + (self.moe if self.moe_enabled else self.feed_forward)(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        (self.moe if self.moe_enabled else self.feed_forward).init_weights(self.init_std)


class MoETransformer(Transformer):
    """Token embedding → attention + MoE blocks → final norm → output head."""

    block_cls = MoEBlock

    @torch.no_grad()
    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """RoPE table, and MoE expert bias and load counters back to zero."""
        super().init_buffers(device)
        for module in self.modules():
            if isinstance(module, MoE):
                module.init_buffers()


def moe_flops_per_token(args: MoEModelArgs, num_params: int, seq_len: int) -> int:
    """Training FLOPs per token counting only active parameters: each MoE layer runs k of its experts."""
    m = args.moe
    per_expert = 3 * args.dim * m.hidden_dim
    moe_layers = sum(1 for i in range(args.n_layers) if i >= args.n_dense_layers)
    # The router's E·dim and the expert bias are counted as active; inactive experts are not.
    inactive = moe_layers * (m.num_experts - m.top_k) * per_expert
    return llama_flops_per_token(args, num_params - inactive, seq_len)


def count_moe_params(model: nn.Module) -> tuple[int, int]:
    """(total, active per token) parameter counts of a full MoE model."""
    total = sum(p.numel() for p in model.parameters())
    args = model.args
    m = args.moe
    moe_layers = sum(1 for i in range(args.n_layers) if i >= args.n_dense_layers)
    return total, total - moe_layers * (m.num_experts - m.top_k) * 3 * args.dim * m.hidden_dim
