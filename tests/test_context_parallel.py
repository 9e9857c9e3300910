"""Context parallelism and document masking reproduce a single-process run on the same batch."""

import dataclasses

import numpy as np
import pytest
import torch
from harness import BUILTIN_EXACT, TINY, assert_eval_parity, assert_parity, launch, reference, train

from titanlite.models.llama3 import flavors
from titanlite.models.llama3.model import Transformer
from titanlite.config import load as config_load
from titanlite.layers.attention import AttnContext
from titanlite.errors import ConfigError
from titanlite.parallel.context import shard_sequence
from titanlite.data.loader import document_spans
from titanlite.preflight import preflight

CP2 = ["--parallelism.context_parallel_degree", "2"]
DOCS = ["--data.document_mask", "true"]


def test_head_tail_layout():
    seq = torch.arange(16)[None]
    assert shard_sequence(seq, 0, 2).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert shard_sequence(seq, 1, 2).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert shard_sequence(seq, 3, 4).tolist() == [[6, 7, 8, 9]]


def test_seq_len_not_divisible_by_two_cp_is_refused_in_preflight():
    cfg, _ = config_load.load([*TINY, *CP2, "--training.seq_len", "66"])
    with pytest.raises(ConfigError, match=r"seq_len 66 .*context_parallel_degree 2 = 4"):
        preflight(cfg, world_size=2)
    run = launch(2, [*TINY, *CP2, "--training.seq_len", "66"], timeout=120)
    assert run.returncode != 0 and run.output.count("titanlite: error: training.seq_len 66") == 2, run.output[-2000:]
    assert not run.metrics


def test_sequence_parallel_needs_seq_len_divisible_by_tp_x_cp():
    cfg, _ = config_load.load([*TINY, *CP2, "--parallelism.tensor_parallel_degree", "4", "--training.seq_len", "12"])
    with pytest.raises(ConfigError, match=r"seq_len 12 .*tensor_parallel_degree 4 x context_parallel_degree 2"):
        preflight(cfg, world_size=8)


def test_document_mask_with_streaming_is_refused(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a b c"}\n')
    with pytest.raises(ConfigError, match=r"data.document_mask .*data.streaming"):
        config_load.load([*DOCS, "--data.streaming", "true", "--data.path", str(corpus)])


def test_document_spans_restart_positions_at_each_document():
    spans = document_spans(np.array([0, 5, 7, 20]), start=3, length=6)  # tokens 3..8
    assert spans["document_ids"].tolist() == [0, 0, 1, 1, 2, 2]
    assert spans["positions"].tolist() == [0, 1, 0, 1, 0, 1]


def test_document_mask_matches_each_document_alone():
    torch.manual_seed(0)
    args = dataclasses.replace(flavors["debugmodel"], max_seq_len=64)
    model = Transformer(args)
    model.init_weights(0)
    doc_starts, start, seq_len = np.array([0, 30, 41, 42, 90]), 10, 64  # first document began earlier
    tokens = torch.randint(0, args.vocab_size, (2, seq_len))
    spans = document_spans(doc_starts, start, seq_len)
    ctx = AttnContext(spans["positions"].expand(2, -1), spans["document_ids"].expand(2, -1))
    with torch.no_grad():
        packed = model(tokens, ctx)
        bounds = [0, *(int(s) - start for s in doc_starts if start < s < start + seq_len), seq_len]
        alone = torch.cat([model(tokens[:, a:b]) for a, b in zip(bounds, bounds[1:])], dim=1)
        causal = model(tokens)
    assert len(bounds) == 5
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(causal, alone, atol=1e-3)  # the mask changed something


def test_cp2_matches_single_process_in_training_and_validation():
    """Validation and the [eval] tasks' log-likelihoods on each rank's share of the sequence; exact
    match generated on the whole sequence by both cp ranks."""
    val = [*TINY, "--data.holdout_fraction", "0.01", "--validation.freq", "5", "--validation.steps", "2",
           *BUILTIN_EXACT]
    ref = reference(val)
    run = train(2, [*val, *CP2])
    assert_parity(ref.losses, run.losses)
    assert assert_eval_parity(ref, run) == 2 * 5
    assert [s for s, _ in run.val_losses] == [5, 10]
    for (_, a), (_, b) in zip(ref.val_losses, run.val_losses):
        assert abs(a - b) / a < 1e-5, (ref.val_losses, run.val_losses)


def test_cp4_matches_single_process():
    """cp 4 (four head-tail chunk pairs); cp composed with FSDP, TP, EP and PP is in the family
    parity tests (qwen3 fsdp2_cp2_tp2, gpt_oss, deepseek_v3, qwen3_moe ep2xcp2xpp2)."""
    ref = reference(TINY)
    run = train(4, [*TINY, "--parallelism.context_parallel_degree", "4"])
    assert_parity(ref.losses, run.losses)
    assert_parity([r["grad_norm"] for r in ref.metrics], [r["grad_norm"] for r in run.metrics], 1e-5, 1e-3)
