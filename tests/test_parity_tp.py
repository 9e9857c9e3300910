"""Tensor, sequence and loss parallel, alone and composed with FSDP/HSDP on one mesh,
reproduce a single-process run on the same global batch (fp32, gloo)."""

import re

import pytest
from harness import TINY, Run, assert_grad_parity, assert_parity, reference, train

from titanlite.config import load as config_load
from titanlite.errors import ConfigError
from titanlite.preflight import preflight

GLOBAL4 = [*TINY, "--training.global_batch_size", "4"]


def _parallel(replicate: int, shard: int, tp: int, loss_parallel: bool) -> list[str]:
    dp = replicate * shard
    return [*GLOBAL4, "--training.local_batch_size", str(4 // dp),
            "--parallelism.data_parallel_replicate_degree", str(replicate),
            "--parallelism.data_parallel_shard_degree", str(shard),
            "--parallelism.tensor_parallel_degree", str(tp),
            "--parallelism.loss_parallel", str(loss_parallel).lower()]


def _check(ref: Run, run: Run) -> None:
    assert_parity(ref.losses, run.losses)
    # fp32 norms of differently split gradients differ at ~1e-6, more than the losses do
    assert_parity([r["grad_norm"] for r in ref.metrics], [r["grad_norm"] for r in run.metrics], 1e-5, 1e-3)


# Loss parallel sees only the tp mesh, so gathered logits are tried once with sequence parallel
# (tp2 here) and once with FSDP x TP (test_tp_without_sequence_parallel), not in every layout.
# HSDP's replica all-reduce is in hsdp2x2xtp2 (and in test_muon's HSDP layouts).
# TP 4's gradients are checked in test_every_gradient_matches_under_tp; TP 2 with loss parallel
# is a part of fsdp2xtp2.
@pytest.mark.parametrize("replicate,shard,tp,loss_parallel", [
    (1, 1, 2, False), (1, 2, 2, True), (2, 2, 2, True)],
    ids=["tp2-gathered_logits", "fsdp2xtp2", "hsdp2x2xtp2"])
def test_tp_matches_single_process(replicate, shard, tp, loss_parallel):
    ref = reference(TINY)  # one process's global batch is TINY's local 4: test_context_parallel's run, shared
    run = train(replicate * shard * tp, _parallel(replicate, shard, tp, loss_parallel))
    _check(ref, run)


def test_tp_without_sequence_parallel():
    """FSDP 2 x TP 2 with replicated activations and gathered logits; TP 2 alone without
    sequence parallel is in test_every_gradient_matches_under_tp (here and for qwen3)."""
    ref = reference(TINY)
    _check(ref, train(4, [*_parallel(1, 2, 2, False), "--parallelism.sequence_parallel", "false"]))


@pytest.mark.parametrize("extra,world,message", [
    (["--parallelism.tensor_parallel_degree", "3"], 3,
     "n_heads 8 is not divisible by parallelism.tensor_parallel_degree 3"),
    (["--parallelism.tensor_parallel_degree", "8"], 8, "tensor_parallel_degree 8 exceeds n_kv_heads 4"),
    (["--parallelism.tensor_parallel_degree", "4", "--model.vocab_size", "514"], 4,
     "vocab_size 514 is not divisible by parallelism.tensor_parallel_degree 4"),
    (["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "65"], 2,
     "training.seq_len 65 is not divisible by parallelism.tensor_parallel_degree 2"),
], ids=["heads", "kv_heads", "vocab", "seq_len"])
def test_bad_tp_degree_is_refused_in_preflight(extra, world, message):
    # preflight runs before any process group or weight exists (run_train.sh --check calls it)
    cfg, _ = config_load.load([*TINY, *extra])
    with pytest.raises(ConfigError, match=re.escape(message)):
        preflight(cfg, world)


@pytest.mark.parametrize("nproc,args", [(4, ["2", "2", "+", "1", "4"]), (2, ["1", "2", "nosp"])],
                         ids=["fsdp2xtp2_and_tp4", "tp2_no_sequence_parallel"])
def test_every_gradient_matches_under_tp(nproc, args):
    assert_grad_parity("llama3", nproc, args)
