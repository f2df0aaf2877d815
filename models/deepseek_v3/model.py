"""DeepSeek-V2/V3 in plain PyTorch: multi-head latent attention, the first n_dense_layers blocks
with a dense SwiGLU, the rest with an MoE layer (shared experts, sigmoid scores with the expert
bias, group-limited routing). No torch.distributed here."""

from dataclasses import dataclass, field

import torch

from models.common.block import PreNormBlock
from models.common.feed_forward import FeedForward
from models.common.moe import MoE, MoEArgs
from models.common.rope import YarnScaling, rope_cache
from models.deepseek_v3.attention import MultiHeadLatentAttention
from models.moe.model import MoETransformer


@dataclass
class DeepSeekV3Args:
    """Shape of a DeepSeek-V2/V3 model; the flavors in flavors.py fill it in."""

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    vocab_size: int = 4096
    max_seq_len: int = 4096
    norm_eps: float = 1e-6
    q_lora_rank: int | None = None  # None: queries by one full projection (DeepSeek-V2-Lite)
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    inter_dim: int = 768  # hidden size of the dense blocks' SwiGLU
    n_dense_layers: int = 1  # transformers' first_k_dense_replace
    moe: MoEArgs = field(default_factory=lambda: MoEArgs(
        num_experts=8, top_k=2, hidden_dim=128, num_shared_experts=1, score_func="sigmoid", route_norm=True))
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    tie_embeddings: bool = False
    # Multi-token prediction modules after the main model (models/common/mtp.py; transformers'
    # num_nextn_predict_layers): DeepSeek-V3 trains with one.
    mtp_depth: int = 0
    depth_init: bool = True  # scale output-projection init by the layer index, as TorchTitan does

    @property
    def kv_heads(self) -> int:
        """MLA expands its shared latent into one key and value per query head (models/protocol.py)."""
        return self.n_heads

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class DeepSeekV3Block(PreNormBlock):
    """Pre-norm block: x + MLA(norm(x)), then + (dense SwiGLU or MoE)(norm(x))."""

    def __init__(self, layer_id: int, args: DeepSeekV3Args) -> None:
        super().__init__()
        self.attention = MultiHeadLatentAttention(
            args.dim, args.n_heads, args.q_lora_rank, args.kv_lora_rank, args.qk_nope_head_dim,
            args.qk_rope_head_dim, args.v_head_dim, args.rope_scaling)
        self.add_norms(layer_id, args)
        self.moe_enabled = layer_id >= args.n_dense_layers
        if self.moe_enabled:
            self.moe = MoE(args.dim, args.moe)
        else:
            self.feed_forward = FeedForward(args.dim, args.inter_dim)


class DeepSeekV3Transformer(MoETransformer):
    """Token embedding → MLA blocks (dense, then MoE) → final norm → output head. The Llama
    transformer's forward (RoPE positions, document masks, pipeline ends) with MLA blocks and a
    RoPE table over the rotary dimensions only."""

    block_cls = DeepSeekV3Block

    def _make_rope_cache(self) -> torch.Tensor:
        a = self.args
        return rope_cache(a.qk_rope_head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)


def inactive_expert_params(args: DeepSeekV3Args) -> int:
    """Parameters a token does not use: the routed experts each MoE layer (the multi-token prediction
    modules' blocks included) does not choose for it."""
    m = args.moe
    moe_layers = args.n_layers - args.n_dense_layers + args.mtp_depth
    return moe_layers * (m.num_experts - m.top_k) * 3 * args.dim * m.hidden_dim


def deepseek_v3_flops_per_token(args: DeepSeekV3Args, num_params: int, seq_len: int) -> int:
    """Training FLOPs per token: 6 per active non-embedding parameter (the output head once more per
    multi-token prediction depth), plus the causal score (q·k over qk_head_dim) and value (over
    v_head_dim) matmuls of every block, forward and backward (the mask not credited)."""
    embedding = 0 if args.tie_embeddings else args.vocab_size * args.dim
    extra_heads = args.mtp_depth * args.vocab_size * args.dim  # the head runs once more per depth
    dense = num_params - inactive_expert_params(args) - embedding + extra_heads
    blocks = args.n_layers + args.mtp_depth
    return 6 * dense + 6 * blocks * args.n_heads * (args.qk_head_dim + args.v_head_dim) * seq_len
