"""A Llama-style transformer whose feed-forward is a Mixture of Experts (after optional dense layers)."""

from dataclasses import dataclass, field

import torch

from models.common.moe import MoE, MoEArgs
from models.llama3.model import LlamaArgs, Transformer, TransformerBlock, llama_flops_per_token


@dataclass
class MoEModelArgs(LlamaArgs):
    """Llama shape plus the MoE layer; the first n_dense_layers blocks keep a dense SwiGLU."""

    moe: MoEArgs = field(default_factory=MoEArgs)
    n_dense_layers: int = 0


class MoEBlock(TransformerBlock):
    """A Llama block whose feed-forward is an MoE layer (`moe`), unless it is one of the dense first
    blocks."""

    def __init__(self, layer_id: int, args: MoEModelArgs) -> None:
        super().__init__(layer_id, args)
        self.moe_enabled = layer_id >= args.n_dense_layers
        if self.moe_enabled:
            del self.feed_forward
            self.moe = MoE(args.dim, args.moe)


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


def inactive_expert_params(args: MoEModelArgs) -> int:
    """Parameters a token does not use: the routed experts each MoE layer does not choose for it."""
    m = args.moe
    moe_layers = sum(1 for i in range(args.n_layers) if i >= getattr(args, "n_dense_layers", 0))
    return moe_layers * (m.num_experts - m.top_k) * 3 * args.dim * m.hidden_dim


def moe_flops_per_token(args: MoEModelArgs, num_params: int, seq_len: int) -> int:
    """Training FLOPs per token counting only active parameters: each MoE layer runs k of its experts.
    The router's E·dim and the expert bias are counted as active."""
    return llama_flops_per_token(args, num_params - inactive_expert_params(args), seq_len)

