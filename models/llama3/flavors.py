"""Llama 3 flavors: a CPU-sized debug model and the published Llama 3.1 / 3.2 shapes."""

from models.common.rope import RopeScaling
from models.llama3.model import LlamaArgs

_LLAMA31_SCALING = RopeScaling(scale_factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
_LLAMA32_SCALING = RopeScaling(scale_factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)

LLAMA3_FLAVORS: dict[str, LlamaArgs] = {
    # vocab 4096 = the embedded Shakespeare tokenizer (assets/tokenizer/tokenizer.json).
    # max_seq_len 8192 leaves room for long-context (context-parallel) experiments.
    "debug": LlamaArgs(dim=256, n_layers=6, n_heads=16, vocab_size=4096, rope_theta=500000, max_seq_len=8192),
    # A still smaller shape for fast multi-process tests.
    "tiny": LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=64),
    # A mid-size shape (GPT-2 small's width and depth, 125M parameters) for checks at a real size.
    "125M": LlamaArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=32768, rope_theta=500000,
                      max_seq_len=8192),
    "1B": LlamaArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim_multiplier=1.5,
        multiple_of=256, rope_theta=500000, rope_scaling=_LLAMA32_SCALING, max_seq_len=131072,
        tie_embeddings=True,
    ),
    "3B": LlamaArgs(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256, ffn_dim_multiplier=1.0,
        multiple_of=256, rope_theta=500000, rope_scaling=_LLAMA32_SCALING, max_seq_len=131072,
        tie_embeddings=True,
    ),
    "8B": LlamaArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim_multiplier=1.3,
        multiple_of=1024, rope_theta=500000, rope_scaling=_LLAMA31_SCALING, max_seq_len=131072,
    ),
    "70B": LlamaArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, ffn_dim_multiplier=1.3,
        multiple_of=4096, rope_theta=500000, rope_scaling=_LLAMA31_SCALING, max_seq_len=131072,
    ),
    "405B": LlamaArgs(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
        ffn_dim_multiplier=1.2, multiple_of=4096, rope_theta=500000, rope_scaling=_LLAMA31_SCALING,
        max_seq_len=131072,
    ),
}
