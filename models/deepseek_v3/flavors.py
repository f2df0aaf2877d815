"""DeepSeek flavors: CPU-sized debug/tiny models and the published DeepSeek-V2-Lite, V2 and V3 shapes.

All route with Kiln's one group-limited router (models/common/moe.py): a group ranks by the sum of
its two best scores, as in DeepSeek-V3. V2 and V2-Lite differ from their releases there: they score
by softmax without renormalising the top k (as released), but V2 ranked groups by their best score
alone, and both balanced with auxiliary losses where Kiln moves the expert bias.
"""

from models.common.moe import MoEArgs
from models.common.rope import YarnScaling
from models.deepseek_v3.model import DeepSeekV3Args

# YaRN to 40 × the 4K pretraining context, as released (V2 and V2-Lite with mscale 0.707).
_V2_YARN = YarnScaling(factor=40, original_max_seq_len=4096, beta_fast=32, beta_slow=1, mscale=0.707,
                       mscale_all_dim=0.707)
_V3_YARN = YarnScaling(factor=40, original_max_seq_len=4096, beta_fast=32, beta_slow=1, mscale=1.0,
                       mscale_all_dim=1.0)

DEEPSEEK_V3_FLAVORS: dict[str, DeepSeekV3Args] = {
    # vocab 4096 = the embedded Shakespeare tokenizer. One dense block, then MoE blocks with 8
    # experts in 4 groups (top 2 groups, top 2 experts) and a shared expert. The bias step is ten
    # times V3's 1e-3, as the moe debug flavor, so a 100-step run ends balanced.
    "debug": DeepSeekV3Args(
        dim=256, n_layers=6, n_heads=8, vocab_size=4096, max_seq_len=8192, q_lora_rank=128,
        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, inter_dim=768,
        n_dense_layers=1,
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=256, num_shared_experts=1, score_func="sigmoid",
                    route_norm=True, load_balance_coeff=1e-2, num_groups=4, top_k_groups=2),
    ),
    # For fast multi-process tests: 2 blocks (one dense, one MoE), low-rank queries (V2-Lite's
    # full-rank ones are the 16B flavor's, and tests/unit/test_deepseek_v3_hf.py's).
    "tiny": DeepSeekV3Args(
        dim=64, n_layers=2, n_heads=4, vocab_size=4096, max_seq_len=2048, q_lora_rank=24,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, inter_dim=128,
        n_dense_layers=1,
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=64, num_shared_experts=1, score_func="sigmoid",
                    route_norm=True, num_groups=4, top_k_groups=2),
    ),
    # DeepSeek-V2-Lite: full-rank queries, 64 experts (top 6, 2 shared), first block dense.
    "16B": DeepSeekV3Args(
        dim=2048, n_layers=27, n_heads=16, vocab_size=102400, max_seq_len=163840, q_lora_rank=None,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, inter_dim=10944,
        n_dense_layers=1, rope_scaling=_V2_YARN,
        moe=MoEArgs(num_experts=64, top_k=6, hidden_dim=1408, num_shared_experts=2, score_func="softmax"),
    ),
    # DeepSeek-V2: 160 experts (top 6 within 3 of 8 groups, 2 shared), route scale 16.
    "236B": DeepSeekV3Args(
        dim=5120, n_layers=60, n_heads=128, vocab_size=102400, max_seq_len=163840, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, inter_dim=12288,
        n_dense_layers=1, rope_scaling=_V2_YARN,
        moe=MoEArgs(num_experts=160, top_k=6, hidden_dim=1536, num_shared_experts=2, score_func="softmax",
                    route_scale=16.0, num_groups=8, top_k_groups=3),
    ),
    # DeepSeek-V3 (and R1): 256 experts (top 8 within 4 of 8 groups, 1 shared), sigmoid scores
    # renormalised and scaled by 2.5, first 3 blocks dense, one multi-token prediction module.
    "671B": DeepSeekV3Args(
        dim=7168, n_layers=61, n_heads=128, vocab_size=129280, max_seq_len=163840, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, inter_dim=18432,
        n_dense_layers=3, rope_scaling=_V3_YARN, mtp_depth=1,
        moe=MoEArgs(num_experts=256, top_k=8, hidden_dim=2048, num_shared_experts=1, score_func="sigmoid",
                    route_norm=True, route_scale=2.5, num_groups=8, top_k_groups=4),
    ),
}
