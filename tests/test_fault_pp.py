"""Fault handling under pipeline parallelism (pp 2): a non-finite loss that only the last stage
computes, a stop signal that only the first stage receives, and a hang, are each seen by every
rank at the same step."""

import signal
import time

from harness import TINY
from test_fault import LIMIT_S, _errors, spawn

PP2 = [*TINY, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]


def test_nonfinite_loss_on_the_last_stage_stops_both_stages(tmp_path):
    ranks = spawn(2, PP2, tmp_path, faults="nan@3:1")  # rank 1 holds the last stage and the loss
    assert ranks.wait() == [1, 1], [ranks.log(0), ranks.log(1)]
    for r in range(2):
        (err,) = _errors(ranks.log(r))
        assert "step 3: non-finite loss (training.on_nonfinite = stop)" in err
    assert [m["step"] for m in ranks.metrics()] == [1, 2]


def test_signal_to_the_first_stage_stops_both_at_the_same_step(tmp_path):
    ranks = spawn(2, [*PP2, "--training.steps", "400", "--job.shutdown_timeout_s", "20"], tmp_path)
    deadline = time.monotonic() + LIMIT_S
    while not any(m["step"] >= 3 for m in ranks.metrics()):
        assert time.monotonic() < deadline and all(p.poll() is None for p in ranks.procs), ranks.log(0)
        time.sleep(0.05)
    ranks.procs[0].send_signal(signal.SIGTERM)
    assert ranks.wait() == [0, 0], [ranks.log(0), ranks.log(1)]
    stopped = {ranks.done(r)["step"] for r in range(2)}
    assert len(stopped) == 1 and 3 <= stopped.pop() < 400
    assert ranks.done(0)["signal"] == "SIGTERM"


def test_hang_on_the_last_stage_is_reported_by_both(tmp_path):
    ranks = spawn(2, [*PP2, "--comm.train_timeout_s", "4", "--comm.init_timeout_s", "60"], tmp_path,
                  faults="hang@3:1")
    start = time.monotonic()
    assert ranks.wait() == [124, 124], [ranks.log(0), ranks.log(1)]
    assert time.monotonic() - start < 90
    for r in range(2):
        (err,) = _errors(ranks.log(r))
        assert "step 3: exceeded comm.train_timeout_s (4 s)" in err and f"hang/rank-{r}.txt" in err
    # the first stage waits inside the pipeline schedule for the stage that hangs
    assert "schedules.py" in (tmp_path / "hang" / "rank-0.txt").read_text()
