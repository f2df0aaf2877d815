"""Tests the Llama 3 model: published sizes, forward, init, RoPE, causality, GQA, FLOPs, imports."""

import ast
import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models.common.attention import Attention
from models.common.rope import RopeScaling, apply_rope, rope_cache, rope_frequencies
from models.llama3.flavors import LLAMA3_FLAVORS
from models.llama3.model import LlamaArgs, Transformer, llama_flops_per_token

REPO = Path(__file__).resolve().parents[2]

# Published sizes (Meta's Llama 3.1 / 3.2 model cards and config.json intermediate_size).
PUBLISHED = {  # flavor: (parameters, feed-forward hidden size)
    "1B": (1.23e9, 8192),
    "3B": (3.21e9, 8192),
    "8B": (8.03e9, 14336),
    "70B": (70.6e9, 28672),
    "405B": (405.9e9, 53248),
}


def build(flavor: str | LlamaArgs, seed: int = 0) -> Transformer:
    """A model built on meta, moved to CPU with to_empty and initialised from `seed`."""
    args = LLAMA3_FLAVORS[flavor] if isinstance(flavor, str) else flavor
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights(buffer_device="cpu")
    return model


def count(model: torch.nn.Module) -> int:
    """Unique parameter count (a tied weight once)."""
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_sizes(flavor: str) -> None:
    with torch.device("meta"):
        model = Transformer(LLAMA3_FLAVORS[flavor])
    params, hidden = PUBLISHED[flavor]
    assert count(model) == pytest.approx(params, rel=0.01)
    assert model.layers["0"].feed_forward.w1.weight.shape[0] == hidden


def test_debug_forward_shape() -> None:
    model = build("debug")
    tokens = torch.randint(0, 4096, (2, 32))
    logits = model(tokens)
    assert logits.shape == (2, 32, 4096)
    assert torch.isfinite(logits).all()


def test_initial_loss_near_uniform() -> None:
    model = build("debug", seed=1)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 4096, (4, 65), generator=gen)
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()
    assert abs(loss - math.log(4096)) < 1.0


def test_init_after_to_empty_is_finite_and_seeded() -> None:
    a, b, c = build("tiny", seed=5), build("tiny", seed=5), build("tiny", seed=6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.isfinite(pa).all(), name
        assert torch.equal(pa, pb), name
        if "norm" not in name:  # norms are ones whatever the seed
            assert not torch.equal(pa, pc), name
    expected = rope_cache(a.args.head_dim, a.args.max_seq_len, a.args.rope_theta, None)
    assert torch.equal(a.rope_cache, expected)


def _complex_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Reference RoPE as in Meta's llama code: pair (x[2i], x[2i+1]) × e^{i·pos·theta^(-2i/d)}."""
    seq, d = x.shape[1], x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), freqs)
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2))
    rotated = xc * torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    return torch.view_as_real(rotated).flatten(-2)


def test_rope_matches_complex_reference_and_keeps_norms() -> None:
    x = torch.randn(2, 12, 3, 16)
    out = apply_rope(x, rope_cache(16, 12, 10000.0, None))
    torch.testing.assert_close(out.double(), _complex_rope(x, 10000.0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out[:, 1:], x[:, 1:])  # positions > 0 really rotate


@pytest.mark.parametrize("scaling", [None, RopeScaling(8.0, 1.0, 4.0, 8192)])
def test_rope_scores_depend_on_offset_only(scaling: RopeScaling | None) -> None:
    d, seq = 64, 40
    cache = rope_cache(d, seq, 500000.0, scaling)
    q, k = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    rq = apply_rope(q.expand(1, seq, 1, d), cache.double())[0, :, 0]
    rk = apply_rope(k.expand(1, seq, 1, d), cache.double())[0, :, 0]
    for m, n in [(5, 2), (10, 7), (39, 36)]:  # offset 3 everywhere
        assert (rq[m] @ rk[n]).item() == pytest.approx((rq[3] @ rk[0]).item(), rel=1e-4, abs=1e-4)
    assert (rq[9] @ rk[0]).item() != pytest.approx((rq[3] @ rk[0]).item(), rel=1e-3)


def test_rope_scaling_matches_llama31_rule() -> None:
    """Meta's apply_scaling, rewritten per frequency: short wavelengths kept, long ones / factor."""
    s = RopeScaling(8.0, 1.0, 4.0, 8192)
    base = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    expected = []
    for f in base.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4.0:
            expected.append(f)
        elif wavelen > 8192 / 1.0:
            expected.append(f / 8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            expected.append((1 - smooth) * f / 8.0 + smooth * f)
    got = rope_frequencies(128, 500000.0, s).double()
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=0)


def test_causal() -> None:
    model = build("tiny")
    tokens = torch.randint(0, 4096, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (tokens[0, 10] + 1) % 4096
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gqa_matches_repeated_kv_reference() -> None:
    args = LLAMA3_FLAVORS["tiny"]
    assert args.kv_heads == 2 < args.n_heads == 4
    model = build("tiny")
    attn: Attention = model.layers["0"].attention
    hd = args.head_dim
    assert attn.wk.weight.shape == (2 * hd, args.dim)
    x, seq = torch.randn(2, 8, args.dim), 8
    rope = model.rope_cache[:seq]
    with torch.no_grad():
        got = attn(x, rope)
        q = apply_rope(attn.wq(x).view(2, seq, 4, hd), rope).transpose(1, 2)
        k = apply_rope(attn.wk(x).view(2, seq, 2, hd), rope).transpose(1, 2)
        v = attn.wv(x).view(2, seq, 2, hd).transpose(1, 2)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # q heads 0,1 → kv 0
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
        ref = attn.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, seq, -1))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def _imports_distributed(path: Path) -> bool:
    """Whether a source file imports torch.distributed or reaches it as an attribute."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            if any(a.name.startswith("torch.distributed") for a in node.names):
                return True
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("torch.distributed"):
                return True
            if node.module == "torch" and any(a.name == "distributed" for a in node.names):
                return True
        if isinstance(node, ast.Attribute) and node.attr == "distributed":
            return True
    return False


def test_model_code_never_uses_torch_distributed(tmp_path: Path) -> None:
    files = [REPO / "models/llama3/model.py", *sorted((REPO / "models/common").glob("*.py"))]
    assert len(files) >= 5
    offenders = [str(f.relative_to(REPO)) for f in files if _imports_distributed(f)]
    assert offenders == []
    for bad in ("from torch.distributed.tensor import DTensor", "import torch.distributed as dist",
                "from torch import distributed", "import torch\ntorch.distributed.barrier()"):
        (tmp_path / "bad.py").write_text(bad + "\n")
        assert _imports_distributed(tmp_path / "bad.py"), bad  # the checker itself can fail


def test_tied_embeddings_share_the_tensor() -> None:
    with torch.device("meta"):
        big = Transformer(LLAMA3_FLAVORS["1B"])
    assert big.output.weight is big.tok_embeddings.weight
    tied_args = dataclasses.replace(LLAMA3_FLAVORS["tiny"], tie_embeddings=True)
    tied, untied = Transformer(tied_args), Transformer(LLAMA3_FLAVORS["tiny"])
    assert tied.output.weight is tied.tok_embeddings.weight
    assert count(untied) - count(tied) == 4096 * 64


def test_tied_embeddings_survive_to_empty() -> None:
    """The trainer's route (meta → to_empty → init_weights) keeps the head tied and initialised."""
    tied = build(dataclasses.replace(LLAMA3_FLAVORS["tiny"], tie_embeddings=True))
    assert tied.output.weight is tied.tok_embeddings.weight
    assert count(tied) == count(build("tiny")) - 4096 * 64
    assert tied(torch.randint(0, 4096, (1, 8))).shape == (1, 8, 4096)


def test_flops_per_token_by_hand() -> None:
    # debug: dim 256, 6 layers, 16 heads of 16, MHA, vocab 4096, SwiGLU hidden 256·⌈682/256⌉ = 768.
    attn = 4 * 256 * 256
    ffn = 3 * 256 * 768
    norms = 2 * 256
    non_embedding = 6 * (attn + ffn + norms) + 256 + 4096 * 256  # + final norm + output head
    seq = 128
    expected = 6 * non_embedding + 12 * 6 * 16 * 16 * seq
    args = LLAMA3_FLAVORS["debug"]
    with torch.device("meta"):
        n = count(Transformer(args))
    assert n == non_embedding + 4096 * 256
    assert llama_flops_per_token(args, n, seq) == expected
