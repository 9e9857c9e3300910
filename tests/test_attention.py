"""The attention seam: every mask kind under each backend against a dense reference (one process,
cp 2 x tp 2), and refusals. Training parity of a model with windows and sinks (documents across
cp chunks, eager and compiled under full AC) is gpt-oss's: tests/test_gpt_oss_parity.py."""

import dataclasses

import pytest
import torch
from attention_parity import run as seam_parity
from harness import REPO, TINY, launch, spawn_ranks

from titanlite.config import load as config_load
from titanlite.preflight import preflight
from titanlite.errors import ConfigError
from titanlite.layers import attention as attn
from titanlite.models.llama3 import flavors


def test_every_kind_matches_the_dense_reference_in_one_process(monkeypatch):
    monkeypatch.setattr(attn, "QUERY_BLOCK", 16)
    assert seam_parity() == 0


@pytest.mark.parametrize("cp,tp", [(2, 2)])  # each rank a cp shard of its tp heads
def test_every_kind_matches_the_dense_reference_under_cp_and_tp(cp, tp, tmp_path):
    codes, output = spawn_ranks(cp * tp, [str(REPO / "tests" / "attention_parity.py"), str(cp), str(tp), str(tmp_path)],
                                timeout=300)
    cases = sum(1 for _ in __import__("attention_parity").cases())
    assert output.count("worst abs diff") == cp * tp * cases and "MISMATCH" not in output, (codes, output[-4000:])
    # and generation: FSDP-saved models read shard by shard for tp generate one process's tokens
    # (tests/generate_tp.py)
    assert output.count("generate tp") == cp * tp * len(__import__("generate_tp").MODELS), output[-4000:]


def test_masked_blocks_hold_no_mask_of_all_keys(monkeypatch):
    """The sdpa path's largest mask is one block of queries against the keys it may see."""
    sizes = []
    real = attn._sdpa

    def spy(q, k, v, mask, scale):
        sizes.append(None if mask is None else tuple(mask.shape[-2:]))
        return real(q, k, v, mask, scale)

    monkeypatch.setattr(attn, "_sdpa", spy)
    monkeypatch.setattr(attn, "QUERY_BLOCK", 64)
    q = torch.randn(1, 2, 1024, 8)
    attn.attention(q, q, q, window=100)
    assert len(sizes) == 1024 // 64 and max(n for _, n in sizes) <= 64 + 100 - 1, sizes


def test_varlen_reads_the_document_bounds_once_a_batch(monkeypatch):
    """varlen's kernel is CUDA only; a stand-in receives the packed bounds: documents restart per
    row, and the longest document is read to the host once for every layer of the batch."""
    import torch.nn.attention.varlen as varlen
    seen, built = [], []
    monkeypatch.setattr(varlen, "varlen_attn", lambda q, k, v, cu, _, longest, *a, **kw:
                        seen.append((cu.tolist(), longest)) or torch.zeros_like(q))
    real = attn._document_bounds
    monkeypatch.setattr(attn, "_document_bounds", lambda *a: built.append(1) or real(*a))
    ctx = attn.AttnSetup("varlen").context(document_ids=torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]]))
    q = torch.randn(2, 4, 6, 8)
    for _ in range(3):  # three layers
        assert attn.attention(q, q[:, :2], q[:, :2], ctx).shape == q.shape
    assert seen == [([0, 2, 5, 6, 7, 12], 5)] * 3 and len(built) == 1


def test_varlen_repeats_key_value_heads_for_a_kernel_without_enable_gqa(monkeypatch):
    """torch 2.11's varlen_attn takes no enable_gqa: the seam hands it each query head's own key
    and value head (query head i reads key/value head i // group, as enable_gqa would)."""
    import torch.nn.attention.varlen as varlen
    calls = []
    monkeypatch.setattr(varlen, "varlen_attn", lambda q, k, v, cu_q, cu_k, max_q, max_k, **kw:
                        calls.append((k.clone(), sorted(kw))) or torch.zeros_like(q))
    monkeypatch.setattr(attn, "_VARLEN_GQA", False)
    ctx = attn.AttnSetup(backend="varlen").context(document_ids=torch.zeros(1, 6, dtype=torch.long))
    q, kv = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    attn.attention(q, kv, kv, ctx)
    (k, kwargs), = calls
    assert kwargs == ["scale", "window_size"] and k.shape == (6, 4, 8)
    assert torch.equal(k[:, 1], kv[0, 0]) and torch.equal(k[:, 2], kv[0, 1])


SWA = ["--model.flavor", "debugmodel_swa", *TINY[2:]]


def _refusal(args: list[str], world: int = 1) -> str:
    cfg, _ = config_load.load(args)
    with pytest.raises(ConfigError) as e:
        preflight(cfg, world)
    return str(e.value)


def test_bad_attention_input_is_refused_in_one_line(monkeypatch):
    with pytest.raises(ConfigError, match="model.attn_backend"):
        config_load.load([*TINY, "--model.attn_backend", "flash"])
    assert "no FlexAttention backward on CPU" in _refusal([*TINY, "--model.attn_backend", "flex"])
    assert "CUDA only" in _refusal([*TINY, "--model.attn_backend", "varlen"])
    wide = dataclasses.replace(flavors["debugmodel_swa"], sliding_window=1 << 20)
    monkeypatch.setitem(flavors, "debugmodel_swa", wide)
    assert "larger than the model's context" in _refusal(SWA)
    monkeypatch.setitem(flavors, "debugmodel_swa", dataclasses.replace(wide, sliding_window=-3))
    assert "positive integer" in _refusal(SWA)
    monkeypatch.setitem(flavors, "debugmodel_swa", dataclasses.replace(wide, sliding_window=8, layer_types=("x",)))
    assert "layer_types" in _refusal(SWA)
    run = launch(1, [*TINY, "--model.attn_backend", "flex"], timeout=120)
    assert run.returncode != 0 and "titanlite: error: model.attn_backend flex" in run.output, run.output[-1500:]


def test_the_dry_run_traces_flex_as_sdpa_and_says_so(capsys):
    from titanlite.dryrun.report import print_table, report
    from titanlite.dryrun.run import dry_run
    from titanlite.dryrun.hardware import GPUS

    cp2 = [*TINY, "--parallelism.context_parallel_degree", "2"]
    cfg, _ = config_load.load([*cp2, "--model.attn_backend", "flex"])
    rep = report(dry_run(cfg, 2), GPUS["h100"])
    assert rep["config"]["attn_backend"] == "flex" and rep["roles"][0]["memory_gib"]["peak"] > 0
    print_table(rep)
    assert "model.attn_backend flex traced as sdpa" in capsys.readouterr().out
    cfg, _ = config_load.load([*cp2, "--model.attn_backend", "varlen"])
    with pytest.raises(ConfigError, match="varlen does not split documents over context parallel"):
        dry_run(cfg, 2)
