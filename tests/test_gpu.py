"""What only a CUDA GPU can check: flex attention's backward, the varlen kernel, float8 training,
a compiled bf16 model, and deterministic mode twice bit for bit. Marked `gpu`, run by
tools/gpu_session.sh (`pytest -m gpu tests/test_gpu.py`); every test skips without CUDA, so the
CPU suite pays only their collection."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attention_parity as ap
from titanlite.layers import attention as attn
from titanlite.tools.gpu_attention import seam_errors

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def gpu_shapes(monkeypatch):
    # compiled flex needs head dims of 16 at least; several 16-query blocks per sequence
    monkeypatch.setattr(ap, "DQK", 32)
    monkeypatch.setattr(ap, "DV", 16)
    monkeypatch.setattr(attn, "QUERY_BLOCK", 16)


@pytest.mark.parametrize("docs,window,sinks", [(True, None, False), (False, ap.WINDOW, True), (True, ap.WINDOW, True)])
def test_flex_forward_and_backward_match_the_dense_reference(gpu_shapes, docs, window, sinks):
    errors = seam_errors("flex", torch.float32, docs, window, sinks)
    assert max(errors) < 1e-4, errors


@pytest.mark.parametrize("window", [None, ap.WINDOW])
def test_varlen_matches_sdpa_in_bf16(gpu_shapes, monkeypatch, window):
    """varlen runs in bf16 only: its error against the fp32 reference stays within twice sdpa's
    on the same bf16 inputs (grouped-query heads, packed documents)."""
    monkeypatch.setattr(ap, "DV", 32)  # one head dim for q, k and v
    sdpa = seam_errors("sdpa", torch.bfloat16, True, window, False)
    varlen = seam_errors("varlen", torch.bfloat16, True, window, False)
    assert all(e <= 2 * s + 2e-3 for e, s in zip(varlen, sdpa)), (varlen, sdpa)


def _train(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    """The debug model for 20 steps on one GPU (bf16), every step logged."""
    dump = tmp_path / name
    cmd = [sys.executable, "-m", "titanlite.train", "--config", "debug_model.toml", "--training.steps", "20",
           "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--validation.freq", "0",
           "--job.dump_folder", str(dump), *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "loss" in row]


@pytest.fixture(scope="module")
def bf16_eager(tmp_path_factory) -> list[float]:
    return [r["loss"] for r in _train(tmp_path_factory.mktemp("eager"), "eager")]


def test_bf16_compiled_model_follows_eager(tmp_path, bf16_eager):
    compiled = [r["loss"] for r in _train(tmp_path, "compiled", "--compile.enable", "true")]
    assert len(compiled) == len(bf16_eager) == 20
    # bf16 rounds differently once kernels fuse; 20 steps keep the runs within 2%
    assert max(abs(a - b) / b for a, b in zip(compiled, bf16_eager)) < 2e-2, (compiled, bf16_eager)


def test_float8_training_follows_bf16(tmp_path, bf16_eager):
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability 8.9 (H100 class)")
    f8 = [r["loss"] for r in _train(tmp_path, "float8", "--float8.enable", "true")]
    assert len(f8) == 20 and f8[-1] < f8[0] - 1.0  # it learns
    # tensorwise float8 rounds each matmul input to 3 mantissa bits: within 5% of bf16's losses
    assert max(abs(a - b) / b for a, b in zip(f8, bf16_eager)) < 5e-2, (f8, bf16_eager)


def test_deterministic_mode_repeats_bit_for_bit(tmp_path):
    runs = [_train(tmp_path, f"det{i}", "--training.deterministic", "true") for i in range(2)]
    assert [(r["loss"], r["grad_norm"]) for r in runs[0]] == [(r["loss"], r["grad_norm"]) for r in runs[1]]
