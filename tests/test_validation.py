"""Validation loss and the [eval] tasks' metrics are the same for any layout and micro-batch split;
they reach metrics and TensorBoard; evaluation leaves the training losses bit-identical."""

import json

from harness import TINY, assert_eval_parity, blank_task, eval_rows, train

# A held-out tail of the stdlib source; eval after steps 5 and 10 (the last) over 3 global batches.
VAL = [*TINY, "--data.holdout_fraction", "0.01", "--validation.freq", "5", "--validation.steps", "3",
       "--training.global_batch_size", "8"]


def eval_tasks(folder) -> list[str]:
    """[eval] over a multiple-choice file of 7 rows (21 requests: dp 2 does not divide them), a
    bits-per-byte file whose texts span several 64-token windows, the built-in stdlib_which, and
    harness.blank_task's 7 prompts generated 8 tokens each (exact match)."""
    mc, bpb = folder / "mc.jsonl", folder / "texts.jsonl"
    mc.write_text("".join(json.dumps({"context": f"def f{i}(x):\n    return", "choices": [" x", " None", " 1"],
                                      "gold": i % 3}) + "\n" for i in range(7)))
    bpb.write_text("".join(json.dumps({"text": "import os\n" + "def main():\n    pass\n" * i}) + "\n"
                           for i in range(1, 6)))
    return ["--eval.tasks", f"{mc},{bpb},stdlib_which,{blank_task()}", "--eval.interval", "5", "--eval.limit", "7",
            "--eval.max_new_tokens", "8"]


def test_validation_independent_of_layout_and_accumulation(tmp_path):
    tasks = eval_tasks(tmp_path)
    ref = train(1, [*VAL, "--training.local_batch_size", "8", "--metrics.enable_tensorboard", "true", *tasks])
    plain = train(1, [*VAL, "--training.local_batch_size", "8"])  # no [eval]
    accum = train(1, [*VAL, "--training.local_batch_size", "2", *tasks, "--eval.batch_size", "5"])  # 4 micro-batches
    # dp 2 x tp 2 with loss parallel: the validation loss and the tasks' log-likelihoods run on
    # vocab-sharded logits, generation on the logits gathered (no sequence parallel: it decodes
    # one token at a time); the tasks' requests split over 2 data-parallel ranks
    fsdp_tp = train(4, [*VAL, "--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2",
                        "--parallelism.sequence_parallel", "false", *tasks, "--eval.batch_size", "2"])
    assert ref.losses == plain.losses  # evaluation draws no training RNG and reads no training data
    first, last = eval_rows(ref)
    assert [row["step"] for row in ref.rows if "eval/seconds" in row] == [5, 10]
    assert last["eval/texts/bpb"] < first["eval/texts/bpb"]  # it measures something that learns
    assert 0 < first["eval/blank/exact_match"] < 1  # some prompts match and some not: layouts could differ
    assert assert_eval_parity(ref, accum) == assert_eval_parity(ref, fsdp_tp) == 2 * 8
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
    assert [(e.step, round(e.value, 5)) for e in acc.Scalars("eval/stdlib_which/acc")] == \
        [(5, round(first["eval/stdlib_which/acc"], 5)), (10, round(last["eval/stdlib_which/acc"], 5))]
