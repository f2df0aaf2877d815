"""Qwen3 flavors: CPU-sized debug/tiny models (dense and MoE) and the published Qwen3 shapes.

The published sizes are those of the config.json files of Qwen/Qwen3-*: vocabulary 151936, head
dim 128, 40960 positions, rope_theta 1e6, eps 1e-6; 0.6B, 1.7B and 4B tie the output head to the
embedding. The MoE sizes route over 128 experts, top 8, renormalised, with the auxiliary loss of
router_aux_loss_coef 0.001 and no expert bias (Qwen3 has none, so imported weights route as
published).
"""

from models.common.moe import MoEArgs
from models.qwen3.model import Qwen3Args


def _qwen3_moe(hidden_dim: int, num_experts: int = 128, top_k: int = 8,
               aux_loss_coeff: float = 1e-3) -> MoEArgs:
    """Qwen3-MoE's routing: softmax over all experts, top k renormalised, no shared expert, aux loss."""
    return MoEArgs(num_experts=num_experts, top_k=top_k, hidden_dim=hidden_dim, score_func="softmax",
                   route_norm=True, load_balance_coeff=None, aux_loss_coeff=aux_loss_coeff)


def _published(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, hidden_dim: int, *,
               tie: bool = False, moe: MoEArgs | None = None) -> Qwen3Args:
    return Qwen3Args(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=128,
                     hidden_dim=hidden_dim, vocab_size=151936, norm_eps=1e-6, rope_theta=1e6,
                     max_seq_len=40960, tie_embeddings=tie, moe=moe)


QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    # vocab 4096 = the embedded Shakespeare tokenizer; head_dim 64 ≠ dim / heads = 32, as in Qwen3.
    "debug": Qwen3Args(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=768,
                       vocab_size=4096, max_seq_len=8192),
    # For fast multi-process tests: 2 blocks, head_dim 32 ≠ 64 / 4.
    "tiny": Qwen3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=192,
                      vocab_size=4096, max_seq_len=2048),
    # The same with Qwen3-MoE blocks: 8 experts, top 2 (the auxiliary loss ten times the published
    # coefficient, so that it shows in short runs).
    "moe_debug": Qwen3Args(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=64, vocab_size=4096,
                           max_seq_len=8192, moe=_qwen3_moe(256, 8, 2, aux_loss_coeff=1e-2)),
    "moe_tiny": Qwen3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=4096,
                          max_seq_len=2048, moe=_qwen3_moe(64, 8, 2, aux_loss_coeff=1e-2)),
    # Dense (Qwen/Qwen3-0.6B ... Qwen3-32B).
    "0.6B": _published(1024, 28, 16, 8, 3072, tie=True),
    "1.7B": _published(2048, 28, 16, 8, 6144, tie=True),
    "4B": _published(2560, 36, 32, 8, 9728, tie=True),
    "8B": _published(4096, 36, 32, 8, 12288),
    "14B": _published(5120, 40, 40, 8, 17408),
    "32B": _published(5120, 64, 64, 8, 25600),
    # MoE (Qwen/Qwen3-30B-A3B, Qwen3-235B-A22B); intermediate_size (dense layers) goes unused there.
    "30B-A3B": _published(2048, 48, 32, 4, 6144, moe=_qwen3_moe(768)),
    "235B-A22B": _published(4096, 94, 64, 4, 12288, moe=_qwen3_moe(1536)),
}
