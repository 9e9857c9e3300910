"""Unattended recovery: a corrupt newest checkpoint is passed over for the one before it, and
(with fault_tolerance.max_restarts) a killed, hung or NaN rank restarts the job from the newest
complete checkpoint, logging the losses of a run that never failed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import TINY, Run, launch, train
from test_launcher import output, run_sh

LIMIT_S = 120
CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", "3"]


def _saved(dump: Path) -> list[str]:
    return sorted(p.name for p in (dump / "checkpoint").iterdir())


def test_a_corrupt_newest_checkpoint_falls_back_to_the_one_before(tmp_path):
    # the embedded source reads no text field: every run warns about it (once, rank 0)
    args = [*TINY, "--training.steps", "9", *CKPT, "--data.text_field", "body"]
    straight = train(1, args, dump=tmp_path).losses  # read now: the later runs append to metrics.jsonl
    folder = tmp_path / "checkpoint"
    (shard,) = (folder / "step-9").glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])  # a write cut short
    # a step asked for by name is refused, never swapped for another
    named = launch(1, [*args, "--checkpoint.load_step", "9"], dump=tmp_path, timeout=LIMIT_S)
    errors = [line for line in named.output.splitlines() if line.startswith("titanlite: error:")]
    assert named.returncode == 2 and len(errors) == 1, named.output[-3000:]
    refused = f"titanlite: error: checkpoint.load_step 9: {folder / 'step-9'} failed to load ("
    assert errors[0].startswith(refused), errors
    # resuming by itself: one line, then the step before; keep_latest_k 1 keeps one, the newest
    again = train(1, [*args, "--checkpoint.keep_latest_k", "1"], dump=tmp_path)
    warnings = [line for line in again.output.splitlines() if line.startswith("titanlite: warning:")]
    assert warnings[0].startswith(f"titanlite: warning: checkpoint {folder / 'step-9'} failed to load (")
    assert warnings[0].endswith(f"; falling back to {folder / 'step-6'}") and len(warnings) == 2, warnings
    assert warnings[1].startswith("titanlite: warning: data.text_field = 'body': ignored by this run's data source")
    assert f"resumed from {folder / 'step-6'}" in again.output
    resumed = {m["step"]: m["loss"] for m in again.metrics}  # later rows win: the resumed run's
    assert [resumed[s] for s in (7, 8, 9)] == straight[6:]  # bitwise: resume is exact on CPU
    assert _saved(tmp_path) == ["step-9"]


def _tensorboard(folder: Path) -> dict[int, float]:
    """loss/train as TensorBoard shows it: {step: value}, its purges applied."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = folder.iterdir()
    acc = EventAccumulator(str(run))
    acc.Reload()
    events = acc.Scalars("loss/train")
    assert len({e.step for e in events}) == len(events), [e.step for e in events]
    return {e.step: e.value for e in events}


def test_a_killed_a_hung_and_a_nan_rank_restart_and_log_the_losses_of_a_run_that_never_failed(tmp_path):
    """One launch, four failures: rank 1 SIGKILLed at the start of step 5 (resumed from step 3),
    hung at step 8 (resumed from step 6), its loss NaN at step 9 once (fault_tolerance.
    rerun_on_nonfinite: rerun from step 6, finite, a suspected hardware fault), then NaN at step
    10 in every attempt: the data's, not the machine's, so its rerun stops the run without
    spending the restart left. Each other injected fault fires once per launch."""
    dump = tmp_path / "dump"
    plain = [*TINY, *CKPT, "--comm.train_timeout_s", "4", "--comm.init_timeout_s", "60"]
    args = [*plain, "--metrics.enable_tensorboard", "true", "--fault_tolerance.rerun_on_nonfinite", "true"]
    with run_sh([*args, "--fault_tolerance.max_restarts", "5", "--skip-preflight"], dump,
                env={"TITANLITE_FAULTS": "kill@5:1,hang@8:1,nan@9:1,nan@10:1/every"}) as (proc, out):
        code = proc.wait(timeout=300)
        lines = output(out)
    assert code == 1, lines[-30:]
    assert lines[-1].startswith("titanlite: error: step 10: non-finite loss again on rank 1 ("), lines
    assert ("), rerun after a restart with the same weights and its data on other ranks: a fault of that machine, not "
            "of the data; no more restarts (fault_tolerance.rerun_on_nonfinite). Run without ") in lines[-1], lines[-1]
    assert lines[-1].endswith("(after 4 restarts; fault_tolerance.max_restarts 5)"), lines[-1]
    rows = [json.loads(row) for row in (dump / "restarts.jsonl").read_text().splitlines()]
    restarts, (fault, machine) = [r for r in rows if "restart" in r], [r for r in rows if "restart" not in r]
    # (a hang is named by the first watchdog to fire: the hung rank's or its peer's, whichever)
    assert [(r["restart"], r["resumed_from"]) for r in restarts] == [(1, 3), (2, 6), (3, 6), (4, 9)], rows
    assert [restarts[i]["rank"] for i in (0, 2, 3)] == [1, 1, 1], rows
    assert restarts[0]["cause"] == "rank 1 was killed by SIGKILL at step 5"
    assert restarts[1]["cause"].startswith("step 8: exceeded comm.train_timeout_s (4 s) in compute on rank ")
    assert [r["cause"] for r in restarts[2:]] == ["step 9: non-finite loss on rank 1", "step 10: non-finite loss on rank 1"]
    assert (fault["suspected_hardware_fault"], fault["step"], fault["ranks"]) == (True, 9, [1]) and fault["hosts"]
    # nan@10:1/every stays on rank 1 although the rerun gave rank 1 rank 0's rows: the machine's
    assert (machine["hardware_fault"], machine["step"], machine["ranks"]) == (True, 10, [1]) and machine["hosts"]
    said = [line for line in lines if line.startswith("titanlite: ") and "; restart " in line]
    assert said == [f"titanlite: {r['cause']}; restart {r['restart']} of at most 5, resuming from step "
                    f"{r['resumed_from']}" + (f", to rerun {r['cause'].split(':')[0]} with its data on other ranks "
                                              "(fault_tolerance.rerun_on_nonfinite)" if r["restart"] > 2 else "")
                    for r in restarts], said
    # in the order it happened: each restart's line first, then that attempt's steps; nothing else
    firsts = [i for i, line in enumerate(lines) if line.startswith("titanlite: llama3")]
    assert [lines.index(line) for line in said] == [i - 1 for i in firsts[1:]], lines
    assert any(line.startswith("titanlite: warning: step 9 is finite when rerun with its data on other ranks and the same weights: "
                               "its non-finite result on rank 1 (") for line in lines), lines
    assert not [line for line in lines if not line.startswith(("titanlite: ", "step "))], lines
    assert not any("SIGTERM" in line or "resumed from" in line for line in lines), lines
    straight = train(2, plain, dump=tmp_path / "straight")
    line = Run(0, "", dump).line  # the rows no restart superseded: one per step, bit for bit
    assert [line[s]["loss"] for s in range(1, 10)] == straight.losses[:9] and 10 not in line
    assert [m["step"] for m in Run(0, "", dump).metrics if m["superseded"]] == [4, 7, 7, 8]
    assert _tensorboard(dump / "tb") == {s: pytest.approx(line[s]["loss"], rel=1e-6) for s in range(1, 10)}
    # a bad config is not retried: the launcher stops torchrun at its first report (exit 2)
    with run_sh([*args, "--fault_tolerance.max_restarts", "2", "--skip-preflight", "--data.seed", "7"],
                dump, ngpu=1) as (proc, out):
        code = proc.wait(timeout=LIMIT_S)
        lines = output(out)
    assert code == 2 and lines[-1].startswith("titanlite: error: the checkpoint's data order differs"), lines[-30:]
    assert not any(" restart " in line for line in lines), lines


def test_a_nonfinite_value_names_the_rank_where_it_first_appeared(tmp_path):
    """fault_tolerance.rerun_on_nonfinite on PP 2 (stage 0 on rank 0): activations made NaN on
    stage 0 at step 3 reach the loss on rank 1, yet rank 0 is named; a gradient made NaN on
    rank 1 at step 6 (the loss finite) reaches stage 0's gradients too, yet rank 1 is named.
    Each rerun is finite (the faults fire once): a suspected hardware fault on the rank named.
    One data-parallel rank: the rerun cannot move the data, and says so only if it recurs."""
    dump = tmp_path / "dump"
    args = [*TINY, "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--training.steps", "6",
            "--parallelism.pipeline_parallel_degree", "2", "--fault_tolerance.rerun_on_nonfinite", "true",
            "--fault_tolerance.max_restarts", "2", "--skip-preflight"]
    with run_sh(args, dump, env={"TITANLITE_FAULTS": "nanact@3:0,nangrad@6:1"}) as (proc, out):
        code = proc.wait(timeout=300)
        lines = output(out)
    assert code == 0, lines[-30:]
    rows = [json.loads(row) for row in (dump / "restarts.jsonl").read_text().splitlines()]
    assert [r["cause"] for r in rows if "restart" in r] == ["step 3: non-finite loss on rank 0",
                                                           "step 6: non-finite gradient norm on rank 1"], rows
    assert [(r["step"], r["ranks"]) for r in rows if "suspected_hardware_fault" in r] == [(3, [0]), (6, [1])], rows


@pytest.mark.parametrize("moved,here,now,says", [
    (True, True, True, "a fault of that machine, not of the data"),
    (True, False, True, "but no rank could be named both times: the data's or the machine's, which this run cannot tell"),
    (False, True, True, "the rerun could not move its data (one data-parallel rank, or streamed data): the data's "
                        "or the machine's, which this run cannot tell"),
], ids=["stays", "unnamed_before", "cannot_move"])
def test_a_recurring_nonfinite_step_is_the_machines_only_where_it_stayed(tmp_path, moved, here, now, says):
    """Rerun.again's verdict, on one gloo rank: named before and now with its data moved is the
    machine's (and recorded); not named before, or data that could not move, cannot tell (the
    data's verdict needs a second rank to move to: the launch above)."""
    import torch.distributed as dist
    from titanlite.runtime.restart import Rerun

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        why, fix = Rerun(10, here, str(tmp_path), moved).again(now)
    finally:
        dist.destroy_process_group()
    assert says in why, why
    rows = (tmp_path / "restarts.jsonl").read_text().splitlines() if (tmp_path / "restarts.jsonl").exists() else []
    assert bool(rows) == (moved and here and now) and ("Run without" in fix) == bool(rows)


def test_rerun_on_nonfinite_on_a_gpu_needs_deterministic_steps():
    from titanlite.config import load as config_load
    from titanlite.errors import ConfigError
    from titanlite.preflight import make_plan

    cfg, _ = config_load.load([*TINY, "--fault_tolerance.rerun_on_nonfinite", "true", "--fault_tolerance.max_restarts",
                               "1", "--checkpoint.enable", "true"])
    with pytest.raises(ConfigError, match="a GPU repeats a step only with deterministic kernels: set "
                                          "training.deterministic = true, or rerun_on_nonfinite = false"):
        make_plan(cfg, 1, target="cuda")
    make_plan(cfg, 1, target="cpu")


def test_a_restart_names_its_cause_in_a_line_a_row_and_a_scalar(tmp_path, monkeypatch, capsys):
    """What rank 0 of restarted attempt 1 makes of attempt 0's reports and the agent's record of
    how its silent ranks ended (in process)."""
    from titanlite.runtime.restart import Restart, failure_cause

    env = {"TITANLITE_REPORT_DIR": str(tmp_path), "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3",
           "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    reports = tmp_path / "attempt-0"
    reports.mkdir()
    (tmp_path / "exits").mkdir()
    peer = "titanlite: error: step 4: a collective failed on rank 0; a peer rank probably died or hung (x)"
    (reports / "rank-0.json").write_text(json.dumps({"code": 1, "line": peer, "time": 2.0, "step": 4}))
    for rank, pid in enumerate((100, 101)):
        (reports / f"rank-{rank}.pid").write_text(str(pid))
    (tmp_path / "exits" / "100.json").write_text(json.dumps({"code": 1, "time": 2.1}))
    (tmp_path / "exits" / "101.json").write_text(json.dumps({"signal": "SIGKILL", "time": 1.0}))

    class Board:
        scalars: list = []

        def add_scalar(self, *args):
            self.scalars.append(args)

    restarted = Restart.read()
    assert restarted.line(3, heals=False, rerun=None) == ("titanlite: rank 1 was killed by SIGKILL at step 4; "
                                                           "restart 1 of at most 3, resuming from step 3")
    restarted.record(str(tmp_path), 3, Board())
    assert Board.scalars == [("train/restarts", 1, 3)]
    (row,) = [json.loads(line) for line in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert (row["restart"], row["max_restarts"], row["rank"], row["resumed_from"]) == (1, 3, 1, 3)
    # no record of how it ended (outside Linux): the old words; torchrun's SIGTERM to a survivor is no cause
    assert failure_cause({0: json.loads((reports / "rank-0.json").read_text())}, range(2)) == \
        (1, "rank 1 ended at step 4 without a titanlite message (killed or crashed)")
    silent = {0: {"signal": "SIGTERM", "time": 0.5}, 1: {"code": 3, "time": 1.0}}
    assert failure_cause({}, range(2), silent) == (1, "rank 1 exited with code 3 without a titanlite message")
    # a rank's own failure is the cause, not a peer that torchrun then stopped before it could say anything
    own = "titanlite: error: step 4: out of memory on rank 1; lower training.local_batch_size [rank 1]"
    assert failure_cause({1: {"code": 1, "line": own, "time": 1.0}}, range(2)) == \
        (1, "step 4: out of memory on rank 1; lower training.local_batch_size")
    # a non-finite stop, said by every rank: the rank whose loss it was
    stop = {r: {"code": 1, "line": "titanlite: error: step 9: non-finite loss (...)", "time": 1.0, "step": 9,
                "nonfinite": {"step": 9, "what": "loss", "own": r == 1}, "final": False} for r in range(2)}
    assert failure_cause(stop, range(2)) == (1, "step 9: non-finite loss on rank 1")
