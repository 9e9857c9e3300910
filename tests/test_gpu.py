"""What only a CUDA GPU can check: flex attention's backward, the varlen kernel, float8 training,
a compiled bf16 model, and deterministic mode twice bit for bit. Marked `gpu`, run by
tools/gpu_session.sh (`pytest -m gpu tests/test_gpu.py`); every test skips without CUDA, so the
CPU suite pays only their collection."""

from __future__ import annotations

import importlib.util
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


RUNS = {  # name -> overrides: every training run the tests below compare
    "eager": (),
    "compiled": ("--compile.enable", "true"),
    "float8": ("--float8.enable", "true"),
    "det0": ("--training.deterministic", "true"),
    "det1": ("--training.deterministic", "true"),
}


def _launch(dump: Path, overrides: tuple[str, ...]) -> subprocess.Popen:
    """The debug model for 20 steps on the GPU (bf16), every step logged; its output to dump/log."""
    cmd = [sys.executable, "-m", "titanlite.train", "--config", "debug_model.toml", "--training.steps", "20",
           "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--validation.freq", "0",
           "--job.dump_folder", str(dump), *overrides]
    dump.mkdir(parents=True)
    with open(dump / "log", "w") as log:  # a file, not a pipe: no run waits on a reader
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def _float8_skip() -> str | None:
    if importlib.util.find_spec("torchao") is None:
        return "float8 needs torchao"
    if torch.cuda.get_device_capability() < (8, 9):
        return "float8 matmuls need compute capability 8.9 (H100 class)"
    return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict] | str]:
    """Each run's logged steps, the runs started together: the debug model leaves an H100 nearly
    idle, and one after another they would not fit the GPU session's 8 minutes. Sharing the GPU
    changes no run's arithmetic (each process has its own streams and kernels). A run that
    failed maps to its output's tail, which the tests that read it report."""
    root = tmp_path_factory.mktemp("runs")
    procs = {name: _launch(root / name, overrides) for name, overrides in RUNS.items()
             if name != "float8" or _float8_skip() is None}
    out = {}
    try:
        for name, proc in procs.items():
            proc.wait(timeout=300)
            if proc.returncode != 0:
                out[name] = f"exit {proc.returncode}: " + (root / name / "log").read_text()[-3000:]
                continue
            rows = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
            out[name] = [row for row in rows if "loss" in row]
    finally:  # one run past its time leaves none behind
        for proc in procs.values():
            proc.kill()
    return out


def _rows(runs: dict[str, list[dict] | str], name: str) -> list[dict]:
    assert not isinstance(runs[name], str), f"the {name} run failed: {runs[name]}"
    return runs[name]


def _losses(runs: dict[str, list[dict] | str], name: str) -> list[float]:
    return [row["loss"] for row in _rows(runs, name)]


def test_bf16_compiled_model_follows_eager(runs):
    compiled, eager = _losses(runs, "compiled"), _losses(runs, "eager")
    assert len(compiled) == len(eager) == 20
    # bf16 rounds differently once kernels fuse; 20 steps keep the runs within 2%
    assert max(abs(a - b) / b for a, b in zip(compiled, eager)) < 2e-2, (compiled, eager)


def test_float8_training_follows_bf16(runs):
    if _float8_skip():
        pytest.skip(_float8_skip())
    f8, eager = _losses(runs, "float8"), _losses(runs, "eager")
    assert len(f8) == 20 and f8[-1] < f8[0] - 1.0  # it learns
    # tensorwise float8 rounds each matmul input to 3 mantissa bits: within 5% of bf16's losses
    assert max(abs(a - b) / b for a, b in zip(f8, eager)) < 5e-2, (f8, eager)


def test_deterministic_mode_repeats_bit_for_bit(runs):
    first, second = ([(r["loss"], r["grad_norm"]) for r in _rows(runs, name)] for name in ("det0", "det1"))
    assert len(first) == 20 and first == second
