"""MoE flavors: CPU-sized debug/tiny models and a real shape (Mixtral 8x7B); Qwen3-MoE is the qwen3
family (models/qwen3/, e.g. --model.name qwen3 --model.flavor 30B-A3B)."""

from models.common.moe import MoEArgs
from models.moe.model import MoEModelArgs

MOE_FLAVORS: dict[str, MoEModelArgs] = {
    # dim 256, 6 layers, 8 experts, top 2, one shared expert; vocab = the embedded tokenizer. The
    # bias step is ten times DeepSeek-V3's 1e-3 so that a short debug run (100 steps) ends balanced
    # (benchmarks/notes.md).
    "debug": MoEModelArgs(
        dim=256, n_layers=6, n_heads=16, vocab_size=4096, max_seq_len=8192,
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=256, num_shared_experts=1, load_balance_coeff=1e-2),
    ),
    # For fast multi-process tests: 2 blocks, 8 small experts.
    "tiny": MoEModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=64,
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=64, num_shared_experts=1),
    ),
    # Mixtral 8x7B: 8 experts, top 2 (softmax, the two weights renormalised), no shared expert;
    # trained with an auxiliary loss (router_aux_loss_coef 0.02) rather than an expert bias.
    "mixtral_8x7b": MoEModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, rope_theta=1e6,
        max_seq_len=32768,
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=14336, score_func="softmax", route_norm=True,
                    load_balance_coeff=None, aux_loss_coeff=0.02),
    ),
}
