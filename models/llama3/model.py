"""The Llama 3 dense transformer in plain PyTorch (no torch.distributed: parallelize.py adds that)."""

from dataclasses import dataclass

import torch
from torch import nn

from models.common.attention import Attention, attention_flops_per_token
from models.common.block import PreNormBlock
from models.common.feed_forward import FeedForward, swiglu_hidden_dim
from models.common.init import trunc_normal_
from models.common.mtp import (
    IGNORE_INDEX,
    MultiTokenPredictionModule,
    depth_inputs_and_targets,
    summed_cross_entropy,
)
from models.common.norm import RMSNorm
from models.common.rope import RopeScaling, rope_cache


@dataclass
class LlamaArgs:
    """Shape of a Llama 3 model; the flavors in flavors.py fill it in."""

    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    n_kv_heads: int | None = None  # None = n_heads (plain multi-head attention)
    vocab_size: int = 4096
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    # The feed-forward's hidden size as given (e.g. a Hugging Face intermediate_size); None = derived
    # from multiple_of and ffn_dim_multiplier as Meta's Llama does.
    ffn_hidden_dim: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    depth_init: bool = True  # scale output-projection init by the layer index, as TorchTitan does

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """Hidden units of the SwiGLU feed-forward."""
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        return swiglu_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)


class TransformerBlock(PreNormBlock):
    """Pre-norm block: x + attention(norm(x)), then + feed_forward(norm(x))."""

    def __init__(self, layer_id: int, args: LlamaArgs) -> None:
        super().__init__()
        self.attention = Attention(args.dim, args.n_heads, args.kv_heads)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.add_norms(layer_id, args)


class Transformer(nn.Module):
    """Token embedding → blocks → final norm → output head.

    Layers live in a ModuleDict keyed by index so that a pipeline stage that deletes some keeps
    the original parameter names; every submodule may be None on a stage that does not own it.
    A family that changes only the block (MoE) subclasses this and sets `block_cls`. With
    args.mtp_depth > 0 (a field the family's args may have) the model also has multi-token
    prediction modules `mtp`, keyed by the block index each would have after the last block.
    """

    block_cls: type[nn.Module] = TransformerBlock

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.block_cls(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        depth = getattr(args, "mtp_depth", 0)
        self.mtp = nn.ModuleDict({
            str(args.n_layers + k): MultiTokenPredictionModule(args.dim, args.norm_eps,
                                                               self.block_cls(args.n_layers + k, args))
            for k in range(depth)}) if depth else None
        # The summed cross-entropy of the MTP modules (over depths) and the tokens it counts, left by
        # the last forward given next_tokens, for the training step to weight and add.
        self.mtp_loss: torch.Tensor | None = None
        self.mtp_tokens: torch.Tensor | None = None
        # Not persistent: recomputed by init_buffers(), never stored in checkpoints.
        self.register_buffer("rope_cache", self._make_rope_cache(), persistent=False)
        # Context parallel sets the sequence positions this rank holds (None: 0..seq_len-1).
        self.rope_positions: torch.Tensor | None = None
        # Document masking (packed windows): a BOS token starts a document; attention stays
        # inside documents, and with restart_positions each document's RoPE positions start at 0.
        self.document_bos_id: int | None = None
        self.restart_positions = False

    def _make_rope_cache(self) -> torch.Tensor:
        a = self.args
        return rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)

    def forward(self, tokens: torch.Tensor, next_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [batch, seq] (hidden states on a later pipeline stage) → logits [batch, seq, vocab]
        (hidden states on an earlier stage). With MTP modules and next_tokens [batch, seq, depth + 1]
        (models/common/mtp.py) the modules run too and leave their loss in mtp_loss."""
        depth = len(self.mtp) if self.mtp is not None and next_tokens is not None else 0
        mtp_ids, mtp_targets = depth_inputs_and_targets(next_tokens, depth) if depth else ([], [])
        # Token ids come in on the first stage, hidden states on later ones (whose embedding, when
        # they have one, serves the MTP modules alone). One embedding call for all ids: FSDP and TP
        # see each module run once per forward.
        if tokens.is_floating_point():
            h = tokens
            mtp_embedded = self.tok_embeddings(torch.cat(mtp_ids)).chunk(depth) if depth else ()
        elif depth:
            h, *mtp_embedded = self.tok_embeddings(torch.cat([tokens, *mtp_ids])).chunk(depth + 1)
        else:
            h, mtp_embedded = self.tok_embeddings(tokens), ()
        # Attention slices the table to its sequence length: under sequence parallel (and on a
        # later pipeline stage) h holds only a slice of the sequence.
        rope = self.rope_cache
        if self.rope_positions is not None:
            rope = rope.index_select(0, self.rope_positions.to(rope.device))
        doc_ids = None
        if self.document_bos_id is not None:
            starts = tokens == self.document_bos_id
            doc_ids = starts.cumsum(1)
            if self.restart_positions:
                index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
                start_of_doc = torch.where(starts, index, torch.zeros_like(index)).cummax(1).values
                rope = rope[index - start_of_doc]  # [batch, seq, head_dim]
        for layer in self.layers.values():
            h = layer(h, rope, doc_ids)
        if self.norm is None:
            return h
        h = self.norm(h)
        if not depth:
            return self.output(h)
        # Each depth's normed state; one call of the shared head for the main model and every depth.
        heads, previous = [h], h
        for module, embedded in zip(self.mtp.values(), mtp_embedded, strict=True):
            previous, normed = module(previous, embedded, rope, doc_ids)
            heads.append(normed)
        logits, *mtp_logits = self.output(torch.cat(heads)).chunk(depth + 1)
        self.mtp_loss = sum(summed_cross_entropy(logits_k, targets_k)
                            for logits_k, targets_k in zip(mtp_logits, mtp_targets, strict=True))
        self.mtp_tokens = sum((t != IGNORE_INDEX).sum() for t in mtp_targets)
        return logits

    @torch.no_grad()
    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute the RoPE table (needed after to_empty() from the meta device)."""
        self.rope_cache = self._make_rope_cache().to(device or self.rope_cache.device)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialise every parameter and buffer in place (works after to_empty())."""
        self.init_buffers(buffer_device)
        if self.args.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            # to_empty() gives each module its own new tensor: tie them again.
            self.output.weight = self.tok_embeddings.weight
        if self.tok_embeddings is not None:
            # A tied embedding doubles as the output head, so it gets the head's small scale.
            std = self.args.dim**-0.5 if self.args.tie_embeddings else 1.0
            nn.init.normal_(self.tok_embeddings.weight, std=std)
        for layer in self.layers.values():
            layer.init_weights()
        for module in (self.mtp or {}).values():
            module.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not self.args.tie_embeddings:
            # Small output init keeps the first losses near log(vocab).
            std = self.args.dim**-0.5
            trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


def llama_flops_per_token(args: LlamaArgs, num_params: int, seq_len: int) -> int:
    """Training FLOPs per token: 6 per non-embedding parameter plus causal attention."""
    # The embedding lookup is not a matmul; a tied embedding is also the output head, which is.
    dense = num_params - (0 if args.tie_embeddings else args.vocab_size * args.dim)
    return 6 * dense + attention_flops_per_token(args.n_layers, args.n_heads, args.head_dim, seq_len)
