"""The gated delta rule (titanlite.layers.linear_attention) against transformers' reference
implementations (Qwen3.5's torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule):
forward, final state, gradients, packed documents, the causal convolution and the gated norm."""

import pytest
import torch
import torch.nn.functional as F

from titanlite.layers.attention import AttnContext
from titanlite.layers.linear_attention import (GatedDeltaNet, GatedRMSNorm, causal_conv, chunk_gated_delta_rule,
                                               document_starts, linear_attention, require_fla)

qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

B, S, HK, HV, DK, DV = 2, 50, 2, 4, 16, 8  # S not a multiple of the chunk: the padded tail is exercised
DOCS = torch.tensor([[0] * 20 + [1] * 17 + [2] * 13, [0] * 5 + [1] * 45])


def _inputs(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, S, HK, DK, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(B, S, HV, DV, generator=gen, dtype=dtype)
    g = -2 * torch.rand(B, S, HV, generator=gen, dtype=dtype)
    beta = torch.rand(B, S, HV, generator=gen, dtype=dtype)
    return q, k, v, g, beta


def _recurrent(q, k, v, g, beta, state=None):
    return qwen3_5.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("chunk", [16, 64])
def test_forward_matches_transformers_chunked_and_recurrent(chunk):
    q, k, v, g, beta = _inputs()
    state = torch.randn(B, HV, DK, DV, generator=torch.Generator().manual_seed(1))
    ours, ours_state = linear_attention(q, k, v, g, beta, initial_state=state, chunk_size=chunk)
    ref, ref_state = qwen3_5.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, initial_state=state,
                                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
    rec, rec_state = _recurrent(q, k, v, g, beta, state)
    for theirs, theirs_state in ((ref, ref_state), (rec, rec_state)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
        torch.testing.assert_close(ours_state, theirs_state, rtol=0, atol=1e-5)


def test_gradients_match_autograd_through_recurrent_form():
    # float32, within the forward's 1e-5: both forms compute in float32 whatever their inputs are
    inputs = [x.requires_grad_() for x in _inputs(2)]
    grads = []
    for fn in (lambda *a: chunk_gated_delta_rule(*a, chunk_size=16)[0], lambda *a: _recurrent(*a)[0]):
        out = fn(*inputs)
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
        grads.append(torch.autograd.grad((out * weight).sum(), inputs))
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk", [16, 32])
def test_packed_documents_restart_the_state(chunk):
    """Each document of a packed row equals that document run alone; document starts (5, 20,
    37) fall inside chunks, on none of their boundaries. Steep decays: with chunks of 32, the
    first chunk's two documents differ by over 100 in log decay, where exp overflows (and the
    state carried on is NaN) unless what crosses a document is masked before it."""
    q, k, v, g, beta = _inputs(4)
    g = 20 * g
    ctx = AttnContext(document_ids=DOCS)
    out, _ = linear_attention(q, k, v, g, beta, ctx, chunk_size=chunk)
    worst = 0.0
    for row in range(B):
        for doc in DOCS[row].unique():
            idx = (DOCS[row] == doc).nonzero().flatten()
            cut = slice(int(idx[0]), int(idx[-1]) + 1)
            alone, _ = _recurrent(*(x[row:row + 1, cut] for x in (q, k, v, g, beta)))
            worst = max(worst, (alone - out[row:row + 1, cut]).abs().max().item())
    assert worst < 1e-5
    # and the documents matter: without them the second document reads the first's state
    assert (linear_attention(q, k, v, g, beta, chunk_size=chunk)[0] - out).abs().max() > 1e-2


def test_a_document_starting_at_the_first_token_drops_the_initial_state():
    q, k, v, g, beta = _inputs(5)
    state = torch.randn(B, HV, DK, DV)
    starts = torch.zeros(B, S, dtype=torch.bool)
    starts[:, 0] = True
    with_state, _ = chunk_gated_delta_rule(q, k, v, g, beta, starts, state, chunk_size=16)
    torch.testing.assert_close(with_state, chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16)[0])


def test_causal_conv_matches_conv1d_and_restarts_at_documents():
    gen = torch.Generator().manual_seed(6)
    x, weight = torch.randn(B, S, 12, generator=gen), torch.randn(12, 4, generator=gen)

    def reference(x):  # transformers' causal_conv1d_fn without its activation
        return F.conv1d(x.transpose(1, 2), weight[:, None], padding=3, groups=12)[..., :x.shape[1]].transpose(1, 2)

    torch.testing.assert_close(causal_conv(x, weight), reference(x), rtol=0, atol=1e-6)
    out = causal_conv(x, weight, document_starts(AttnContext(document_ids=DOCS), S))
    for row in range(B):
        for doc in DOCS[row].unique():
            idx = (DOCS[row] == doc).nonzero().flatten()
            cut = slice(int(idx[0]), int(idx[-1]) + 1)
            torch.testing.assert_close(out[row:row + 1, cut], reference(x[row:row + 1, cut]), rtol=0, atol=1e-6)


def test_gated_rms_norm_matches_transformers():
    ours, theirs = GatedRMSNorm(DV, eps=1e-6), qwen3_5.Qwen3_5RMSNormGated(DV, eps=1e-6)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
    x, z = torch.randn(3, DV), torch.randn(3, DV)
    torch.testing.assert_close(ours(x, z), theirs(x, z), rtol=0, atol=1e-6)


def test_layer_matches_transformers_gated_deltanet():
    """The whole layer: separate q/k/v projections and convolutions equal transformers' fused ones."""
    from transformers import Qwen3_5TextConfig
    cfg = Qwen3_5TextConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                            linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=1,
                            layer_types=["linear_attention"])
    torch.manual_seed(7)
    theirs = qwen3_5.Qwen3_5GatedDeltaNet(cfg, 0)
    ours = GatedDeltaNet(32, 2, 4, 8, 6, conv_kernel=4, norm_eps=cfg.rms_norm_eps, chunk_size=16)
    kd = 16
    with torch.no_grad():
        q, k, v = theirs.in_proj_qkv.weight.split([kd, kd, 24])
        cq, ck, cv = theirs.conv1d.weight[:, 0].split([kd, kd, 24])
        for name, value in dict(wq=q, wk=k, wv=v, conv_q=cq, conv_k=ck, conv_v=cv, wz=theirs.in_proj_z.weight,
                                wb=theirs.in_proj_b.weight, wa=theirs.in_proj_a.weight, dt_bias=theirs.dt_bias,
                                A_log=theirs.A_log, wo=theirs.out_proj.weight).items():
            ours.get_parameter(name if name in ("conv_q", "conv_k", "conv_v", "dt_bias", "A_log")
                               else f"{name}.weight").copy_(value)
        ours.norm.weight.uniform_(0.5, 1.5)
        theirs.norm.weight.copy_(ours.norm.weight)
    x = torch.randn(B, S, 32)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-5)


def test_fla_backend_refused_in_one_line_where_missing():
    try:
        import fla  # noqa: F401
        pytest.skip("flash-linear-attention is installed here")
    except ImportError:
        pass
    with pytest.raises(ImportError, match=r"^linear_backend fla needs flash-linear-attention .*torch"):
        require_fla()


def test_flops_formula_matches_flop_counter():
    """What one more chunk costs to train, as FlopCounterMode counts it, is the formula's count
    per token (each sequence's first and last chunk skip some state products: measured as the
    difference of two lengths, those cancel)."""
    from torch.utils.flop_counter import FlopCounterMode

    from titanlite.layers.linear_attention import flops_per_token

    def counted(seq, chunk, dk, dv):
        gen = torch.Generator().manual_seed(8)
        q, k = (torch.randn(2, seq, 3, dk, generator=gen, requires_grad=True) for _ in range(2))
        v = torch.randn(2, seq, 3, dv, generator=gen, requires_grad=True)
        g, beta = (-torch.rand(2, seq, 3, generator=gen)).requires_grad_(), torch.rand(2, seq, 3, generator=gen)
        with FlopCounterMode(display=False) as counter:
            chunk_gated_delta_rule(q, k, v, g, beta.requires_grad_(), chunk_size=chunk)[0].sum().backward()
        return counter.get_total_flops()

    for chunk, dk, dv in ((16, 16, 8), (32, 8, 24)):
        extra = counted(4 * chunk, chunk, dk, dv) - counted(2 * chunk, chunk, dk, dv)
        assert extra == 2 * 3 * 2 * chunk * flops_per_token(dk, dv, chunk)


def test_compiled_layer_matches_eager_with_documents():
    """torch.compile (fullgraph, as per-block compile runs blocks) takes the layer whole, packed
    documents included, and computes what eager does."""
    torch.manual_seed(9)
    layer = GatedDeltaNet(32, 2, 4, 8, 6, chunk_size=16)
    with torch.no_grad():
        for p in (layer.conv_q, layer.conv_k, layer.conv_v, layer.A_log):
            p.normal_(0, 0.5)
    x = torch.randn(B, S, 32, requires_grad=True)
    ctx = AttnContext(document_ids=DOCS)
    outs = []
    for fn in (layer, torch.compile(layer, fullgraph=True)):
        out = fn(x, None, None, ctx)
        grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
        outs.append((out, grads))
    (eager, eager_grads), (compiled, compiled_grads) = outs
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)
    for a, b in zip(compiled_grads, eager_grads):  # per tensor, relative to its largest entry (tests/grad_parity.py)
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
