"""The recipes of docs/recipes.md: z-loss, batch-size and sequence-length warm-up, checkpoint merging."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titanlite.config.job import Compile
from titanlite.loss import IGNORE_INDEX, Z_LOSS, ExtraLosses, build_loss_fn, cross_entropy_sum


def _dense_reference(logits: torch.Tensor, labels: torch.Tensor, z: float) -> tuple[float, float, torch.Tensor]:
    """(cross-entropy sum, z-loss sum, gradient of (both) / targets), written out densely in fp32."""
    x = logits.clone().requires_grad_()
    mask = labels != IGNORE_INDEX
    ce = F.cross_entropy(x.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    z_sum = z * torch.logsumexp(x, -1)[mask].square().sum()
    ((ce + z_sum) / mask.sum()).backward()
    return ce.item(), z_sum.item(), x.grad


@pytest.mark.parametrize("chunk_bytes", [1 << 28, 4 * 96 * 10], ids=["whole", "chunks_of_10"])
def test_z_loss_value_and_gradient_equal_a_dense_reference(monkeypatch, chunk_bytes):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 48, 96, generator=gen) * 4 + 3  # logsumexp far from 0
    labels = torch.randint(0, 96, (2, 48), generator=gen)
    labels[0, :5] = labels[1, 40:] = IGNORE_INDEX  # not targets: no z-loss either
    z = 1e-2
    ref_ce, ref_z, ref_grad = _dense_reference(logits, labels, z)
    monkeypatch.setattr("titanlite.loss.CHUNK_BYTES", chunk_bytes)
    loss_fn = build_loss_fn(Compile(), loss_parallel=False, z_loss=z)
    x = logits.clone().requires_grad_()
    n = (labels != IGNORE_INDEX).sum()
    extra = ExtraLosses()
    with extra.collect(n) as sums:
        ce = loss_fn(x, labels, extra)
        (ce / n).backward()
    assert ce.item() == pytest.approx(ref_ce, rel=1e-6)  # the loss logged: the cross-entropy alone
    assert sums[Z_LOSS].item() == pytest.approx(ref_z, rel=1e-6)
    torch.testing.assert_close(x.grad, ref_grad, rtol=1e-6, atol=1e-9)
    # outside a training step (validation) the cross-entropy, as without z-loss
    with torch.no_grad():
        assert loss_fn(logits, labels).item() == cross_entropy_sum(logits, labels).item()


def test_z_loss_off_is_the_plain_loss():
    # nothing on the path when off: the very function every run used before
    assert build_loss_fn(Compile(), loss_parallel=False, z_loss=0.0) is cross_entropy_sum
