"""Unattended recovery: a corrupt newest checkpoint is passed over for the one before it, and
(with fault_tolerance.max_restarts) a killed or hung rank restarts the job from the newest
complete checkpoint, logging the losses of a run that never failed."""

from __future__ import annotations

from pathlib import Path

from harness import TINY, launch, train

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
    assert errors[0].startswith(f"titanlite: error: checkpoint.load_step 9: {folder / 'step-9'} failed to load ("), errors
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

