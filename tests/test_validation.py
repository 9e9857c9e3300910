"""Validation loss is the same for any layout and micro-batch split; it reaches metrics and TensorBoard."""

from harness import TINY, train

# A held-out tail of the stdlib source; eval after steps 5 and 10 (the last) over 3 global batches.
VAL = [*TINY, "--data.holdout_fraction", "0.01", "--validation.freq", "5", "--validation.steps", "3",
       "--training.global_batch_size", "8"]


def test_validation_independent_of_layout_and_accumulation():
    ref = train(1, [*VAL, "--training.local_batch_size", "8", "--metrics.enable_tensorboard", "true"])
    accum = train(1, [*VAL, "--training.local_batch_size", "2"])  # 4 micro-batches
    # dp 2 x tp 2 with loss parallel: the validation loss runs on vocab-sharded logits
    fsdp_tp = train(4, [*VAL, "--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"])
    assert [s for s, _ in ref.val_losses] == [5, 10]
    assert [r["epoch"] for r in ref.metrics] == [0] * 10
    for run in (accum, fsdp_tp):
        assert [s for s, _ in run.val_losses] == [5, 10]
        for (_, a), (_, b) in zip(ref.val_losses, run.val_losses):
            assert abs(a - b) / a < 1e-6, (ref.val_losses, run.val_losses)
    assert ref.val_losses[1][1] < ref.val_losses[0][1]  # it measures something that learns

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (ref.dump / "tb").iterdir()
    acc = EventAccumulator(str(events))
    acc.Reload()
    assert [(e.step, round(e.value, 5)) for e in acc.Scalars("loss/validation")] == \
        [(s, round(v, 5)) for s, v in ref.val_losses]
