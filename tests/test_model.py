"""Llama 3 shapes: published parameter counts (on meta), forward shapes, init."""

import pytest
import torch

import titanlite.models.llama3 as llama3
from titanlite.model_spec import available, get_model_spec

PUBLISHED = {"1B": 1_235_814_400, "3B": 3_212_749_824, "8B": 8_030_261_248,
             "70B": 70_553_706_496, "405B": 405_853_388_800}


@pytest.mark.parametrize("flavor,count", PUBLISHED.items())
def test_published_parameter_counts(flavor, count):
    with torch.device("meta"):
        model = llama3.Transformer(llama3.flavors[flavor])
    assert sum(p.numel() for p in model.parameters()) == count


def test_debug_model_is_small_and_runs():
    args = llama3.flavors["debugmodel"]
    model = llama3.Transformer(llama3.flavors["debugmodel"].__class__(**{**args.__dict__, "max_seq_len": 32}))
    model.init_weights(0)
    assert 1e6 < sum(p.numel() for p in model.parameters()) < 1e7
    logits = model(torch.randint(0, args.vocab_size, (2, 32)))
    assert logits.shape == (2, 32, args.vocab_size) and torch.isfinite(logits).all()


def test_init_is_seeded_and_causal():
    args = llama3.flavors["debugmodel"].__class__(**{**llama3.flavors["debugmodel"].__dict__, "max_seq_len": 16})
    a, b = llama3.Transformer(args), llama3.Transformer(args)
    a.init_weights(1)
    b.init_weights(1)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    tokens = torch.randint(0, args.vocab_size, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % args.vocab_size
    # a change at position 10 must not reach earlier positions
    torch.testing.assert_close(a(tokens)[0, :10], a(changed)[0, :10], rtol=0, atol=0)


def test_registry_finds_llama3():
    assert "llama3" in available()
    assert get_model_spec("llama3").flavors is llama3.flavors


def test_chunked_loss_equals_the_whole(monkeypatch):
    """The loss in chunks of 10 tokens (uneven: 128 tokens), each recomputed in backward, against
    the loss over all tokens at once: the same sum and the same logits gradient, ignored targets
    included."""
    from titanlite.loss import IGNORE_INDEX, cross_entropy_sum

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 64, 96, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    labels = torch.randint(0, 96, (2, 64), generator=gen)
    labels[0, :7] = IGNORE_INDEX
    results = []
    for chunk_bytes in (1 << 28, 4 * 96 * 10):
        monkeypatch.setattr("titanlite.loss.CHUNK_BYTES", chunk_bytes)
        x = logits.clone().requires_grad_()
        loss = cross_entropy_sum(x, labels)
        loss.backward()
        results.append((loss.detach(), x.grad))
    (whole, whole_grad), (parts, parts_grad) = results
    assert whole.dtype == torch.float32 and parts == pytest.approx(whole.item(), rel=1e-6)
    torch.testing.assert_close(parts_grad, whole_grad, rtol=0, atol=0)


@pytest.mark.parametrize("family", available())
def test_every_family_built_on_cpu_is_finite_and_seeded(family):
    """spec.build on a real device leaves no uninitialised memory (gpt-oss's expert biases and
    qwen3-moe's experts were torch.empty): three builds under one seed give equal, finite logits."""
    import dataclasses

    spec = get_model_spec(family)
    args = dataclasses.replace(spec.flavors["debugmodel"], max_seq_len=16)
    tokens = torch.arange(16)[None] % args.vocab_size
    logits = []
    for _ in range(3):
        torch.manual_seed(5)
        logits.append(spec.build(args)(tokens))
    assert torch.isfinite(logits[0]).all()
    assert all(torch.equal(logits[0], other) for other in logits[1:])


def test_a_fork_s_top_level_parameter_is_drawn_by_name():
    """A parameter outside the blocks (here a fork's learned residual scale) has an init rule:
    drawn for its name, the same for one seed and different for another."""
    import torch.nn as nn

    args = llama3.flavors["debugmodel"].__class__(**{**llama3.flavors["debugmodel"].__dict__, "max_seq_len": 16})

    class Fork(llama3.Transformer):
        def __init__(self, args):
            super().__init__(args)
            self.residual_scale = nn.Parameter(torch.empty(args.dim))

    a, b, c = Fork(args), Fork(args), Fork(args)
    a.init_weights(1), b.init_weights(1), c.init_weights(2)
    assert torch.equal(a.residual_scale, b.residual_scale) and not torch.equal(a.residual_scale, c.residual_scale)
    assert 0.005 < a.residual_scale.std() < 0.04
