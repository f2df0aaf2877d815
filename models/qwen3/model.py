"""The Qwen3 transformer, dense and MoE, in plain PyTorch (no torch.distributed: parallelize.py adds it).

Llama's blocks with three differences: a head dimension of its own (128 in every published size,
not dim / n_heads), an RMSNorm over head_dim on each head's queries and keys before RoPE (QK-norm),
and no RoPE scaling. A flavor with `moe` args puts Kiln's MoE layer (models/common/moe.py) in place
of the feed-forward of every block: Qwen3-MoE routes by softmax over all experts, top k,
renormalised, with no shared expert, and balances the load with an auxiliary loss.
"""

from dataclasses import dataclass

import torch

from models.common.attention import Attention
from models.common.block import PreNormBlock
from models.common.feed_forward import FeedForward
from models.common.moe import MoE, MoEArgs
from models.common.rope import rope_cache
from models.llama3.model import Transformer, llama_flops_per_token
from models.moe.model import moe_flops_per_token


@dataclass
class Qwen3Args:
    """Shape of a Qwen3 model (the names of config.json in the comments); flavors.py fills it in."""

    dim: int = 256  # hidden_size
    n_layers: int = 6  # num_hidden_layers
    n_heads: int = 16  # num_attention_heads
    n_kv_heads: int | None = None  # num_key_value_heads; None = n_heads
    head_dim: int = 128
    hidden_dim: int = 768  # intermediate_size: the dense SwiGLU's hidden units
    vocab_size: int = 4096
    norm_eps: float = 1e-6  # rms_norm_eps, also the QK-norms'
    rope_theta: float = 1e6
    max_seq_len: int = 40960  # max_position_embeddings
    tie_embeddings: bool = False  # tie_word_embeddings
    depth_init: bool = True  # scale output-projection init by the layer index, as Llama's
    moe: MoEArgs | None = None  # None: dense; else every block's feed-forward is this MoE layer

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def rope_scaling(self) -> None:  # Qwen3 has none (Llama's Transformer reads it)
        return None


class Qwen3Block(PreNormBlock):
    """Pre-norm block: x + attention(norm(x)), then + feed_forward(norm(x)) (or + moe(norm(x)))."""

    def __init__(self, layer_id: int, args: Qwen3Args) -> None:
        super().__init__()
        self.attention = Attention(args.dim, args.n_heads, args.kv_heads, head_dim=args.head_dim,
                                   qk_norm_eps=args.norm_eps)
        self.moe_enabled = args.moe is not None
        if self.moe_enabled:
            self.moe = MoE(args.dim, args.moe)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.add_norms(layer_id, args)


class Qwen3Transformer(Transformer):
    """Token embedding → Qwen3 blocks → final norm → output head (Llama's ends, hooks and init)."""

    block_cls = Qwen3Block

    def _make_rope_cache(self) -> torch.Tensor:
        a = self.args
        return rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, None)

    @torch.no_grad()
    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """RoPE table, and the MoE layers' expert bias and load counters back to zero."""
        super().init_buffers(device)
        for module in self.modules():
            if isinstance(module, MoE):
                module.init_buffers()


def qwen3_flops_per_token(args: Qwen3Args, num_params: int, seq_len: int) -> int:
    """Training FLOPs per token: 6 per active non-embedding parameter plus causal attention."""
    if args.moe is None:
        return llama_flops_per_token(args, num_params, seq_len)
    return moe_flops_per_token(args, num_params, seq_len)
