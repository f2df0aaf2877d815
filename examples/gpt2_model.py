"""A GPT-2-style model that registers itself with Kiln from outside the repository.

LayerNorm with biases, learned position embeddings, a GELU MLP: nothing of Llama's. Copy this
file anywhere and train it with no edit inside Kiln (and no PYTHONPATH: custom_import takes the
file's path, or its module name when the file sits beside the --config file):

    torchrun --nproc-per-node 2 train.py --config llama_debug \
        --job.custom_import /folder/with/gpt2_model.py --model.name gpt2 --model.flavor tiny \
        --parallelism.tensor_parallel_degree 2

It meets the model contract (models/protocol.py): blocks in `layers`, its ends in `tok_embeddings`
(tokens + positions: all that runs before the blocks), `norm` and `output`, and
init_weights / init_buffers. It brings its own tensor-parallel plan (Megatron-style, without
sequence parallel, so the learned positions stay a plain addition) and uses Kiln's generic cut
into pipeline stages. It has no `rope_positions` / `core_attention` hooks, so context parallel is
refused for it and generation recomputes the whole sequence per token (correct, slower).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from models import ModelSpec, register_model_spec
from parallelisms.compose import finish_parallelize, tensor_parallelize
from parallelisms.pipeline import make_stage_model
from parallelisms.tensor_parallel import ReplicateParallel


@dataclass
class GPT2Args:
    """Shape of a GPT-2 model: the contract's fields (models/protocol.py) and a norm epsilon."""

    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    vocab_size: int = 50304
    max_seq_len: int = 1024
    norm_eps: float = 1e-5

    @property
    def kv_heads(self) -> int:  # plain multi-head attention
        return self.n_heads


class Embeddings(nn.Module):
    """Token embedding plus a learned embedding of each position."""

    def __init__(self, args: GPT2Args) -> None:
        super().__init__()
        self.tokens = nn.Embedding(args.vocab_size, args.dim)
        self.positions = nn.Embedding(args.max_seq_len, args.dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))


class SelfAttention(nn.Module):
    """Causal multi-head attention with biases; q, k and v are separate so TP can split each by heads."""

    def __init__(self, args: GPT2Args) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.q, self.k, self.v = (nn.Linear(args.dim, args.dim) for _ in range(3))
        self.proj = nn.Linear(args.dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallel each rank holds some of them.
        q, k, v = (lin(x).view(b, s, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """dim → 4·dim → GELU (tanh) → dim."""

    def __init__(self, args: GPT2Args) -> None:
        super().__init__()
        self.fc = nn.Linear(args.dim, 4 * args.dim)
        self.proj = nn.Linear(4 * args.dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, args: GPT2Args) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attn = SelfAttention(args)
        self.ln_2 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """Embeddings → blocks → final LayerNorm → output head; an end is None on a pipeline stage
    that does not own it."""

    def __init__(self, args: GPT2Args) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = Embeddings(args)
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """GPT-2's init: N(0, 0.02) weights, zero biases, residual projections scaled by depth."""
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                residual = name.endswith(("attn.proj", "mlp.proj"))
                std = 0.02 / math.sqrt(2 * self.args.n_layers) if residual else 0.02
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """GPT-2 has no buffers (positions are learned)."""


def gpt2_tp_plan(loss_parallel: bool) -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """(top plan, block plan): activations stay replicated between blocks (no sequence parallel);
    q/k/v and fc split column-wise, the projections row-wise with an all-reduce; the token
    embedding split by vocabulary rows, the head by vocabulary columns (sharded logits for loss
    parallel). LayerNorms and positions run whole on every TP rank: ReplicateParallel (every
    parameter needs a style, so the optimizer sees DTensors only)."""
    top = {
        "tok_embeddings.tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "tok_embeddings.positions": ReplicateParallel(),
        "norm": ReplicateParallel(),
        "output": ColwiseParallel(input_layouts=Replicate(),
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    block = {"ln_1": ReplicateParallel(), "ln_2": ReplicateParallel(),
             "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
             "attn.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    return top, block


def parallelize_gpt2(model: nn.Module, dims, options) -> nn.Module:
    """Its own TP plan, then Kiln's shared order for the rest (CP needs hooks GPT-2 lacks)."""
    top, block = gpt2_tp_plan(options.loss_parallel)
    tensor_parallelize(model, dims, options, lambda _: block, top_plan=top)
    return finish_parallelize(model, dims, options)


def gpt2_flops_per_token(args: GPT2Args, num_params: int, seq_len: int) -> int:
    """6 per parameter that multiplies (not the two embedding tables), plus causal attention."""
    lookups = (args.vocab_size + args.max_seq_len) * args.dim
    return 6 * (num_params - lookups) + 12 * args.n_layers * args.dim * seq_len


register_model_spec(ModelSpec(
    name="gpt2",
    flavors={"tiny": GPT2Args(dim=64, n_layers=3, n_heads=4, vocab_size=4096, max_seq_len=256),
             "124M": GPT2Args()},
    model_cls=GPT2,
    parallelize_fn=parallelize_gpt2,
    flops_per_token_fn=gpt2_flops_per_token,
    pipeline_fn=make_stage_model,
))
