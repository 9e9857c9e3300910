"""Unattended recovery: a corrupt newest checkpoint is passed over for the one before it, and
(with fault_tolerance.max_restarts) a killed or hung rank restarts the job from the newest
complete checkpoint, logging the losses of a run that never failed."""

from __future__ import annotations

import json
from pathlib import Path

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
    # resuming by itself: one line, then the step before; keep_latest_k 1 keeps the one that loaded
    again = train(1, [*args, "--checkpoint.keep_latest_k", "1"], dump=tmp_path)
    warnings = [line for line in again.output.splitlines() if line.startswith("titanlite: warning:")]
    assert warnings[0].startswith(f"titanlite: warning: checkpoint {folder / 'step-9'} failed to load (")
    assert warnings[0].endswith(f"; falling back to {folder / 'step-6'}") and len(warnings) == 2, warnings
    assert warnings[1].startswith("titanlite: warning: data.text_field = 'body': ignored by this run's data source")
    assert f"resumed from {folder / 'step-6'}" in again.output
    resumed = {m["step"]: m["loss"] for m in again.metrics}  # later rows win: the resumed run's
    assert [resumed[s] for s in (7, 8, 9)] == straight[6:]  # bitwise: resume is exact on CPU
    assert _saved(tmp_path) == ["step-6", "step-9"]


def test_a_killed_and_a_hung_rank_restart_and_log_the_losses_of_a_run_that_never_failed(tmp_path):
    """One launch, two failures: rank 1 SIGKILLed at the start of step 5 (resumed from step 3),
    then hung at step 8 (resumed from step 6). Each injected fault fires once per launch."""
    dump = tmp_path / "dump"
    args = [*TINY, *CKPT, "--comm.train_timeout_s", "4", "--comm.init_timeout_s", "60"]
    with run_sh([*args, "--fault_tolerance.max_restarts", "2", "--skip-preflight"], dump,
                env={"TITANLITE_FAULTS": "kill@5:1,hang@8:1"}) as (proc, out):
        code = proc.wait(timeout=240)
        lines = output(out)
    assert code == 0, lines[-30:]
    restarts = [json.loads(row) for row in (dump / "restarts.jsonl").read_text().splitlines()]
    assert [(r["restart"], r["rank"], r["resumed_from"]) for r in restarts][0] == (1, 1, 3), restarts
    assert restarts[0]["cause"] == "rank 1 ended without a titanlite message (killed or crashed)"
    assert restarts[1]["restart"] == 2 and restarts[1]["resumed_from"] == 6, restarts
    assert restarts[1]["cause"].startswith("step 8: exceeded comm.train_timeout_s (4 s) in compute on rank ")
    said = [line for line in lines if line.startswith("titanlite: restart ")]
    assert said == [f"titanlite: restart {r['restart']} of at most 2 after {r['cause']}; resuming from step "
                    f"{r['resumed_from']}" for r in restarts], said
    assert not any("Traceback" in line for line in lines), lines
    straight = train(2, args, dump=tmp_path / "straight")
    logged = {m["step"]: m["loss"] for m in Run(0, "", dump).metrics}  # later rows win: the restarts'
    assert [logged[s] for s in range(1, 11)] == straight.losses  # bit for bit
    # a bad config is not retried: the launcher stops torchrun at its first report (exit 2)
    with run_sh([*args, "--fault_tolerance.max_restarts", "2", "--skip-preflight", "--data.seed", "7"],
                dump, ngpu=1) as (proc, out):
        code = proc.wait(timeout=LIMIT_S)
        lines = output(out)
    assert code == 2 and lines[-1].startswith("titanlite: error: the checkpoint's data order differs"), lines[-30:]
    assert not any(line.startswith("titanlite: restart") for line in lines), lines


def test_a_restart_names_its_cause_in_a_line_a_row_and_a_scalar(tmp_path, monkeypatch, capsys):
    """What rank 0 of restarted attempt 1 makes of attempt 0's reports (in process)."""
    from titanlite.runtime import restart

    env = {"TITANLITE_REPORT_DIR": str(tmp_path), "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3",
           "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    reports = tmp_path / "attempt-0"
    reports.mkdir()
    peer = "titanlite: error: step 4: a collective failed on rank 0; a peer rank probably died or hung (x)"
    (reports / "rank-0.json").write_text(json.dumps({"code": 1, "line": peer, "time": 2.0}))

    class Board:
        scalars: list = []

        def add_scalar(self, *args):
            self.scalars.append(args)

    restart.record(str(tmp_path), 3, Board())
    assert capsys.readouterr().out == ("titanlite: restart 1 of at most 3 after rank 1 ended without a titanlite "
                                       "message (killed or crashed); resuming from step 3\n")
    assert Board.scalars == [("train/restarts", 1, 3)]
    (row,) = [json.loads(line) for line in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert (row["restart"], row["max_restarts"], row["rank"], row["resumed_from"]) == (1, 3, 1, 3)
    # a rank's own failure is the cause, not a peer that torchrun then stopped before it could say anything
    own = "titanlite: error: step 4: out of memory on rank 1; lower training.local_batch_size [rank 1]"
    assert restart.failure_cause({1: {"code": 1, "line": own, "time": 1.0}}, range(2)) == \
        (1, "step 4: out of memory on rank 1; lower training.local_batch_size")
