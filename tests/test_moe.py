"""titanlite.layers.moe on one process: routing, grouped GEMM against the loop, balancing, the auxiliary loss."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from titanlite.loss import ExtraLosses
from titanlite.layers.moe import AUX_LOSS, MoE, MoEArgs, grouped_mm_supported, update_router_bias

DIM = 64
ARGS = MoEArgs(num_experts=8, top_k=2, hidden=32)


def _moe(args: MoEArgs = ARGS, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(DIM, args)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    return moe


def _x(tokens: int = 96, seed: int = 1) -> torch.Tensor:
    return torch.randn(2, tokens // 2, DIM, generator=torch.Generator().manual_seed(seed))


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, straight from the definition."""
    a = moe.args
    x = x.reshape(-1, DIM)
    logits = x @ moe.router.gate.weight.T
    scores = logits.softmax(-1) if a.score_func == "softmax" else logits.sigmoid()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = torch.topk(scores[t] + moe.router.expert_bias, a.top_k).indices
        w = scores[t, chosen]
        if a.renormalize:
            w = w / w.sum()
        for e, we in zip(chosen.tolist(), w):
            ex = moe.experts
            out[t] += we * (F.silu(x[t] @ ex.w1[e].T) * (x[t] @ ex.w3[e].T)) @ ex.w2[e].T
    if moe.shared is not None:
        out += moe.shared(x)
    return out


@pytest.mark.parametrize("args", [ARGS, dataclasses.replace(ARGS, renormalize=False),
                                  dataclasses.replace(ARGS, score_func="sigmoid", top_k=3, shared_hidden=48)],
                         ids=["softmax-renorm", "softmax", "sigmoid-shared"])
def test_matches_the_definition(args):
    moe, x = _moe(args), _x()
    with torch.no_grad():
        got = moe(x).reshape(-1, DIM)
    assert got.abs().max() > 1  # so that atol below is a relative check
    torch.testing.assert_close(got, _reference(moe, x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(grouped_mm_supported(torch.device("cpu"), torch.float32, (32, DIM)) is not None,
                    reason="grouped_mm does not run here")
def test_grouped_gemm_and_loop_agree_in_forward_and_backward():
    results = []
    for mode in ("on", "off"):
        moe, x = _moe(dataclasses.replace(ARGS, grouped_mm=mode)), _x().requires_grad_()
        out = moe(x)
        assert moe.experts.use_grouped_mm == (mode == "on")
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append([out.detach(), x.grad] + [p.grad for p in moe.parameters()])
    assert len(results[0]) == 6
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_experts_compute_in_the_autocast_dtype():
    """Without FSDP, mixed precision is autocast, which does not cover grouped_mm: the experts
    cast themselves, for a float32 input (a block's residual stream) and a bfloat16 one (an
    input autocast already cast, as DeepSeek-V3's MTP block gets), on both paths."""
    for mode in ("on", "off"):
        moe = _moe(dataclasses.replace(ARGS, grouped_mm=mode))
        want = moe(_x())
        for x in (_x(), _x().bfloat16()):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = moe.experts(x.reshape(-1, DIM)[:16], torch.tensor([16] + [0] * 7))
            assert out.dtype == torch.bfloat16, (mode, x.dtype)
        assert want.dtype == torch.float32


def test_grouped_gemm_forced_where_unsupported_says_why():
    moe = _moe(dataclasses.replace(ARGS, hidden=33, grouped_mm="on"))  # 33 x 4 bytes: not 16-byte strides
    with pytest.raises(RuntimeError, match="grouped_mm = on, but .*16 bytes"):
        moe(_x())


def test_experts_that_receive_no_token():
    moe = _moe()
    with torch.no_grad():
        moe.router.expert_bias[:] = torch.tensor([0, 0, 0, 0, 0, 0, 100.0, 100.0])
        out = moe(_x())
    torch.testing.assert_close(out.reshape(-1, DIM), _reference(moe, _x()), rtol=1e-5, atol=1e-5)
    assert moe.tokens_per_expert.tolist() == [0] * 6 + [96, 96]


def test_bias_moves_selection_only():
    """A bias that forces experts 6 and 7 changes which experts run, but each token's gate
    weights stay its unbiased scores for them, and the bias gets no gradient."""
    moe, x = _moe(dataclasses.replace(ARGS, renormalize=False)), _x()
    moe.router.expert_bias[6:] = 100.0
    weights, ids, scores = moe.router(x.reshape(-1, DIM))
    assert sorted(set(ids.flatten().tolist())) == [6, 7]
    torch.testing.assert_close(weights, scores.gather(-1, ids))
    assert weights.max() < 1  # softmax scores, nowhere near the bias
    assert not moe.router.expert_bias.requires_grad
    assert "router.expert_bias" in moe.state_dict()  # saved with checkpoints
    assert "tokens_per_expert" not in moe.state_dict()


def test_bias_update_moves_towards_the_mean_load():
    moes = [_moe(dataclasses.replace(ARGS, bias_update_rate=0.01), seed=s) for s in (0, 1)]
    loads = torch.tensor([[10.0, 0, 2, 4, 4, 4, 4, 4], [4.0] * 8])
    for m, load in zip(moes, loads):
        m.tokens_per_expert.copy_(load)
    stats = update_router_bias(moes, group=None)
    assert moes[0].router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0, 0, 0, 0, 0])
    assert moes[1].router.expert_bias.tolist() == [0.0] * 8
    assert all(m.tokens_per_expert.sum() == 0 for m in moes)
    assert stats["moe_load_max_over_mean_worst"].item() == pytest.approx(10 / 4)
    assert stats["moe_load_max_over_mean_avg"].item() == pytest.approx((10 / 4 + 1) / 2)
    assert stats["moe_router_bias_norm"].item() == pytest.approx(0.01 * 3 ** 0.5)


def test_counts_accumulate_until_the_update():
    moe = _moe()
    with torch.no_grad():
        moe(_x())
        moe(_x(seed=2))
    assert moe.tokens_per_expert.sum().item() == 2 * 96 * ARGS.top_k


def test_aux_loss_gradient_is_its_sum_over_the_target_count():
    """Inside a step, the layer's term reaches the router as if loss_sum / n_targets were added
    to the loss; its value is collected; outside a step it is inert."""
    args = dataclasses.replace(ARGS, aux_loss_coeff=1.0)
    x, n_targets = _x(), torch.tensor(5.0)
    moe = _moe(args)
    extra = ExtraLosses()
    extra.bind([moe])
    with extra.collect(n_targets) as sums:
        _main_loss(moe(x)).backward()
    got = moe.router.gate.weight.grad.clone()

    ref = _moe(args)
    out = ref(x)  # outside a step: no extra term
    flat = x.reshape(-1, DIM)
    scores = (flat @ ref.router.gate.weight.T).softmax(-1)
    load = torch.bincount(torch.topk(scores, args.top_k).indices.flatten(), minlength=8).float()
    aux_sum = 1.0 * 8 * (scores * (load / load.sum())).sum()
    (_main_loss(out) + aux_sum / n_targets).backward()
    torch.testing.assert_close(sums[AUX_LOSS], aux_sum.detach())
    torch.testing.assert_close(got, ref.router.gate.weight.grad, rtol=1e-5, atol=1e-5 * got.abs().max().item())
    without = _grad_without_aux(x)
    assert (got - without).abs().max() > 0.1 * got.abs().max()  # the term matters


def _main_loss(out: torch.Tensor) -> torch.Tensor:
    return (out * torch.linspace(-0.01, 0.01, out.numel()).view_as(out)).sum()


def _grad_without_aux(x: torch.Tensor) -> torch.Tensor:
    moe = _moe(ARGS)
    extra = ExtraLosses()
    extra.bind([moe])
    with extra.collect(torch.tensor(5.0)):
        _main_loss(moe(x)).backward()
    return moe.router.gate.weight.grad


def test_top_k_larger_than_experts_is_refused():
    with pytest.raises(ValueError, match="top_k 9"):
        MoE(DIM, dataclasses.replace(ARGS, top_k=9))


def test_validation_forward_leaves_the_loads_that_steer_the_bias_alone():
    # titanlite.data.validation runs the parts in eval mode without grad, between a step's
    # forward and its post-step bias update
    moe = _moe(dataclasses.replace(ARGS, bias_update_rate=0.01))
    with torch.no_grad():
        moe(_x())
        loads = moe.tokens_per_expert.clone()
        moe.eval()
        moe(_x(seed=2))
        moe.train()
    assert torch.equal(moe.tokens_per_expert, loads)


def test_a_skipped_step_keeps_the_router_biases_and_drops_its_loads():
    moe = _moe(dataclasses.replace(ARGS, bias_update_rate=0.01))
    moe.tokens_per_expert.copy_(torch.tensor([10.0, 0, 2, 4, 4, 4, 4, 4]))
    update_router_bias([moe], group=None, skipped=torch.tensor(1.0))  # the device flag, unread by the host
    assert moe.router.expert_bias.tolist() == [0.0] * 8 and moe.tokens_per_expert.sum() == 0
