"""Tensor, sequence and loss parallel, alone and composed with FSDP/HSDP on one mesh,
reproduce a single-process run on the same global batch (fp32, gloo)."""

import json
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
from harness import REPO, TINY, Run, _env, assert_grad_parity, assert_parity, reference, train

from titanlite.config import load as config_load
from titanlite.errors import ConfigError
from titanlite.config.preflight import preflight

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
@pytest.mark.parametrize("replicate,shard,tp,loss_parallel", [
    (1, 1, 2, True), (1, 1, 2, False), (1, 1, 4, True), (1, 2, 2, True), (2, 2, 2, True)],
    ids=["tp2-loss_parallel", "tp2-gathered_logits", "tp4", "fsdp2xtp2", "hsdp2x2xtp2"])
def test_tp_matches_single_process(replicate, shard, tp, loss_parallel):
    ref = reference([*GLOBAL4, "--training.local_batch_size", "4"])
    run = train(replicate * shard * tp, _parallel(replicate, shard, tp, loss_parallel))
    _check(ref, run)


@pytest.mark.parametrize("shard", [1, 2], ids=["tp2", "fsdp2xtp2"])
def test_tp_without_sequence_parallel(shard):
    ref = reference([*GLOBAL4, "--training.local_batch_size", "4"])
    _check(ref, train(shard * 2, [*_parallel(1, shard, 2, shard == 1), "--parallelism.sequence_parallel", "false"]))


def test_hsdp_matches_single_process():
    ref = reference([*GLOBAL4, "--training.local_batch_size", "4"])
    _check(ref, train(4, _parallel(2, 2, 1, False)))


def test_tied_embeddings_under_fsdp_and_tp():
    tied = ["--model.flavor", "debugmodel_tied"]
    ref = reference([*GLOBAL4, "--training.local_batch_size", "4", *tied])
    _check(ref, train(4, [*_parallel(1, 2, 2, True), *tied]))


def test_run_train_sh_tp_matches_one_gpu():
    """The user's path: NGPU=2 ./run_train.sh with TP degree 2, against the single-process run
    (the layouts above cover TP composed with data parallel)."""
    dump = Path(tempfile.mkdtemp(prefix="titanlite-sh-"))
    args = [*GLOBAL4, "--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]
    proc = subprocess.run(["./run_train.sh", *args, "--job.dump_folder", str(dump)],
                          capture_output=True, text=True, env=_env({"NGPU": "2"}), cwd=REPO, timeout=600)
    done = all((dump / "status" / f"rank-{r}.done").exists() for r in range(2))
    assert proc.returncode == 0 or done, proc.stdout[-3000:] + proc.stderr[-3000:]
    two = [json.loads(line)["loss"] for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert_parity(reference([*GLOBAL4, "--training.local_batch_size", "4"]).losses, two)


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


@pytest.mark.parametrize("nproc,args", [(4, ["2", "2"]), (2, ["1", "2", "nosp"])],
                         ids=["fsdp2xtp2", "tp2_no_sequence_parallel"])
def test_every_gradient_matches_under_tp(nproc, args):
    assert_grad_parity("llama3", nproc, args)
