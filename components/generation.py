"""Text generation from a trained model: a KV cache, temperature / top-k / top-p sampling, seeded.

Model-agnostic by duck typing (components/ does not import models/): every module with a
`core_attention` attribute gets a KVCache for the duration of generate(), and the model's
`rope_positions` tells RoPE where the new tokens sit.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class KVCache:
    """Keys and values of the tokens seen so far in one attention layer; called as its core attention."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q/k/v [b, heads, new, d] of the new tokens → their attention over every token so far."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        new, total = q.shape[2], self.k.shape[2]
        # New token i sits at position total - new + i and sees keys up to there (none are after
        # a single new token, so then no mask at all).
        mask = None
        if new > 1:
            mask = torch.ones(new, total, dtype=torch.bool, device=q.device).tril(total - new)
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask,
                                              enable_gqa=self.k.shape[1] != q.shape[1])


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator) -> int:
    """One token id from logits [vocab]: greedy at temperature 0, else from the softmax at that
    temperature restricted to the top_k most likely (0 = all) and to the smallest set whose
    probability reaches top_p (1.0 = all)."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = logits.softmax(-1).sort(descending=True)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits[order[drop]] = float("-inf")
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], max_new_tokens: int, *, temperature: float = 0.8,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
             max_seq_len: int | None = None, on_token: Callable[[int], None] | None = None) -> list[int]:
    """Continue prompt (token ids) by up to max_new_tokens; returns the new ids. The prompt is run
    once, then one token per forward thanks to the KV cache."""
    if not prompt:
        raise ValueError("the prompt is empty (no tokens to continue from)")
    device = next(model.parameters()).device
    layers = [m for m in model.modules() if hasattr(m, "core_attention")]
    saved = [m.core_attention for m in layers]
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    out: list[int] = []
    try:
        for m in layers:
            m.core_attention = KVCache()
        x, pos = torch.tensor([prompt], device=device), 0
        for _ in range(max_new_tokens):
            if max_seq_len is not None and pos + x.shape[1] > max_seq_len:
                break
            model.rope_positions = torch.arange(pos, pos + x.shape[1], device=device)
            logits = model(x)[0, -1]
            pos += x.shape[1]
            token = sample_next(logits, temperature, top_k, top_p, generator)
            out.append(token)
            if on_token is not None:
                on_token(token)
            if token == eos_id:
                break
            x = torch.tensor([[token]], device=device)
    finally:
        for m, core in zip(layers, saved, strict=True):
            m.core_attention = core
        model.rope_positions = None
        model.train(was_training)
    return out
