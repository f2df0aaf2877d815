"""Mixture of Experts on one process: the layer against a per-token reference, routing and load
balancing, the auxiliary loss, the flavors' sizes and FLOPs. Training in every layout (expert
parallel included) against the single process is tests/e2e/test_moe_runs.py."""

import pytest
import torch

from models.common.moe import GroupedExperts, MoE, MoEArgs


def _layer(**changes) -> MoE:
    torch.manual_seed(0)
    args = MoEArgs(num_experts=6, top_k=2, hidden_dim=12, num_shared_experts=1, **changes)
    moe = MoE(16, args)
    moe.init_weights(0.02)
    with torch.no_grad():  # larger weights so every part of the output matters
        for p in moe.parameters():
            p.mul_(20)
    return moe


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the chosen experts' SwiGLU outputs weighted by their scores, plus the shared one."""
    a = moe.args
    out = []
    for token in x:
        logits = moe.router.gate.weight @ token
        scores = logits.softmax(-1) if a.score_func == "softmax" else logits.sigmoid()
        chosen = (scores + moe.expert_bias).topk(a.top_k).indices
        weights = scores[chosen]
        if a.route_norm:
            weights = weights / weights.sum()
        y = moe.shared_experts(token)
        for w, e in zip(weights * a.route_scale, chosen, strict=True):
            w1, w2, w3 = moe.experts.w1[e], moe.experts.w2[e], moe.experts.w3[e]
            y = y + w * (w2 @ (torch.nn.functional.silu(w1 @ token) * (w3 @ token)))
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("changes", [{}, {"score_func": "sigmoid", "route_norm": True, "route_scale": 2.5}],
                         ids=["softmax", "sigmoid_norm_scale"])
def test_layer_matches_per_token_reference(changes):
    moe = _layer(**changes)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.linspace(-0.05, 0.05, 6))  # the bias takes part in the choice
    x = torch.randn(2, 9, 16, requires_grad=True)
    out = moe(x)
    ref_x = x.detach().clone().requires_grad_()
    ref = _reference(moe, ref_x.reshape(-1, 16)).reshape(2, 9, 16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), [x, *moe.parameters()])
    ref_grads = torch.autograd.grad(ref.square().sum(), [ref_x, *moe.parameters()])
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


COUNTS = [3, 0, 5, 4]  # rows per expert, an expert without rows included


def _normal_experts() -> GroupedExperts:
    torch.manual_seed(0)
    experts = GroupedExperts(16, 8, 4)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_()
    return experts


def _loop_and_grouped(experts: GroupedExperts, x: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """(output, gradients of x and the weights) by the loop, then by the grouped GEMM. The output's
    gradient is a full tensor, as a layer above gives it."""
    grad = torch.randn(x.shape[0], 16, dtype=torch.bfloat16)
    results = []
    for path in (experts.loop, experts.grouped_mm):
        out = path(x, COUNTS)
        results.append((out, *torch.autograd.grad(out, (x, experts.w1, experts.w2, experts.w3), grad)))
    return results


def test_the_grouped_gemm_cuda_takes_equals_the_loop_the_cpu_takes():
    # bf16 on CPU runs both (the trainer keeps the CPU on the loop: docs/compatibility.md)
    experts = _normal_experts().to(torch.bfloat16)
    x = torch.randn(12, 16, dtype=torch.bfloat16, requires_grad=True)
    results = _loop_and_grouped(experts, x)
    assert GroupedExperts.grouped_mm_takes(x) and not GroupedExperts.grouped_mm_takes(x.float())
    for loop, grouped in zip(*results, strict=True):
        torch.testing.assert_close(grouped, loop, rtol=0.02, atol=0.02)
        assert loop.abs().max() > 1


def test_under_autocast_the_grouped_gemm_computes_in_its_dtype_as_the_loop_does():
    # Layouts FSDP does not cast (TP, PP, DDP alone) run under bf16 autocast with float32 inputs: CUDA
    # takes the grouped GEMM there too, casting as autocast casts the loop's matmuls.
    experts = _normal_experts()
    x = torch.randn(12, 16, requires_grad=True)
    assert not GroupedExperts.grouped_mm_takes(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert GroupedExperts.grouped_mm_takes(x)
        results = _loop_and_grouped(experts, x)
    assert all(out.dtype == torch.bfloat16 for out, *_ in results)
    for loop, grouped in zip(*results, strict=True):
        assert grouped.dtype == loop.dtype
        torch.testing.assert_close(grouped, loop, rtol=0.02, atol=0.02)
        assert loop.abs().max() > 1


def test_bias_steers_choice_not_weights_and_moves_against_load():
    moe = _layer()
    x = torch.randn(40, 16)
    weights, experts, scores = moe.router(x, None)
    bias = torch.zeros(6)
    bias[5] = 10.0  # expert 5 wins every choice, but its weight is still its score
    b_weights, b_experts, _ = moe.router(x, bias)
    assert (b_experts == 5).any(-1).all()
    torch.testing.assert_close(b_weights, scores.gather(-1, b_experts))
    assert not torch.equal(experts, b_experts)
    moe.update_expert_bias(torch.tensor([10.0, 0, 5, 5, 5, 5]))  # mean 5: 0 overloaded, 1 idle
    coeff = moe.args.load_balance_coeff
    assert moe.expert_bias.tolist() == pytest.approx([-coeff, coeff, 0, 0, 0, 0])
    assert moe.tokens_per_expert.sum() == 0


def test_load_counted_once_with_activation_checkpointing():
    from torch.utils.checkpoint import checkpoint

    moe = _layer()
    moe.train()
    x = torch.randn(3, 5, 16, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert moe.tokens_per_expert.sum().item() == 3 * 5 * 2  # tokens × top_k, not twice that


def test_load_counts_the_routed_choices():
    """The layer's load is what routing really chose: per-token top-k choices counted by hand, and
    the imbalance of those counts (not just a number >= 1)."""
    from components.optim.expert_balance import balance_experts, imbalance

    moe = _layer()
    with torch.no_grad():
        moe.expert_bias.copy_(torch.linspace(-0.05, 0.05, 6))
    x = torch.randn(3, 7, 16)
    moe(x)  # a training forward (grad enabled) is what counts
    bias = moe.expert_bias if moe.args.load_balance_coeff is not None else torch.zeros(6)
    expected = [0] * 6
    with torch.no_grad():
        for token in x.reshape(-1, 16):
            scores = (moe.router.gate.weight @ token).softmax(-1)
            for e in (scores + bias).topk(2).indices.tolist():
                expected[e] += 1
    assert sum(expected) == 3 * 7 * 2 and len(set(expected)) > 1  # an uneven batch, so it tells
    bias_before = moe.expert_bias.clone()
    load = balance_experts([("0", moe)], None)
    assert load == {"0": expected}
    assert imbalance(load)["0"] == pytest.approx(max(expected) / (sum(expected) / 6))
    # The bias moved towards the experts that got fewer tokens than the mean (when the layer steers).
    if moe.args.load_balance_coeff:
        under = [e for e in range(6) if expected[e] < sum(expected) / 6]
        assert all(moe.expert_bias[e] > bias_before[e] for e in under)


def test_aux_loss_joins_the_gradient_with_the_trainer_scale():
    """The layer's output is unchanged by the aux loss; its gradient is that of
    loss + aux_loss_scale · aux_loss, computed by hand on a layer without it."""
    with_aux = _layer(aux_loss_coeff=0.3)
    with_aux.train()
    with_aux.aux_loss_scale = 0.25
    plain = _layer()  # same seed: same weights
    plain.train()
    x = torch.randn(2, 7, 16)
    weight = torch.randn(2, 7, 16)
    out = with_aux(x)
    grads = torch.autograd.grad((out * weight).sum(), list(with_aux.parameters()))
    ref_out = plain(x)
    scores = plain.router(x.reshape(-1, 16), plain.expert_bias)[2]
    counts = torch.bincount(plain.router(x.reshape(-1, 16), plain.expert_bias)[1].flatten(), minlength=6)
    aux = with_aux.aux_loss(scores, counts)
    ref = torch.autograd.grad((ref_out * weight).sum() + 0.25 * aux, list(plain.parameters()))
    torch.testing.assert_close(out, ref_out)
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r)
    without = torch.autograd.grad((plain(x) * weight).sum(), [plain.router.gate.weight])[0]
    assert (grads[0] - without).abs().max() > 1e-4  # the router does feel the aux loss


def test_flavor_shapes():
    """The real-shape flavors have their published sizes (total and active parameters)."""
    from models.moe.flavors import MOE_FLAVORS
    from models.moe.model import MoETransformer

    def sizes(flavor: str) -> tuple[float, float]:
        with torch.device("meta"):
            model = MoETransformer(MOE_FLAVORS[flavor])
        total = sum(p.numel() for p in model.parameters())
        a, m = model.args, model.args.moe
        inactive = (a.n_layers - a.n_dense_layers) * (m.num_experts - m.top_k) * 3 * a.dim * m.hidden_dim
        return total / 1e9, (total - inactive) / 1e9

    total, active = sizes("mixtral_8x7b")
    assert total == pytest.approx(46.7, abs=0.1) and active == pytest.approx(12.9, abs=0.1)
    # Qwen3-30B-A3B and 235B-A22B are the qwen3 family's: tests/unit/test_qwen3_hf.py.


def test_flops_count_active_parameters_only():
    """With every expert active the count is the dense one; each expert left out per token removes
    its 3·dim·hidden weights (× 6 FLOPs) in every MoE layer."""
    import dataclasses

    from models.llama3.model import llama_flops_per_token
    from models.moe.flavors import MOE_FLAVORS
    from models.moe.model import MoETransformer, moe_flops_per_token

    args = MOE_FLAVORS["tiny"]
    with torch.device("meta"):
        total = sum(p.numel() for p in MoETransformer(args).parameters())
    all_active = dataclasses.replace(args, moe=dataclasses.replace(args.moe, top_k=args.moe.num_experts))
    assert moe_flops_per_token(all_active, total, 64) == llama_flops_per_token(all_active, total, 64)
    per_expert = 6 * 3 * args.dim * args.moe.hidden_dim * args.n_layers
    assert moe_flops_per_token(all_active, total, 64) - moe_flops_per_token(args, total, 64) == (
        per_expert * (args.moe.num_experts - args.moe.top_k))
