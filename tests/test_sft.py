"""Supervised fine-tuning through the real trainer (train_configs/sft_debug.toml, the built-in chat
set): the loss's normaliser counts the targets over micro-batches and data-parallel ranks, so 2 gloo
ranks x 2 micro-batches train as one process on the same global batch (training and held-out
loss), and a resumed run logs the uninterrupted run's losses bit for bit."""

import shutil

from harness import TINY, assert_parity, train

# samples of 128 positions: chats of every length (1 to 3 per sample), hundreds truncated or dropped
SFT = ["--config", "sft_debug.toml", *TINY, "--training.seq_len", "128", "--training.global_batch_size", "4",
       "--data.holdout_fraction", "0.05", "--validation.freq", "5", "--validation.steps", "2",
       "--checkpoint.enable", "false"]


def test_sft_is_exact_over_ranks_and_micro_batches_and_resumes_bitwise(tmp_path):
    saved = ["--training.local_batch_size", "4", "--checkpoint.enable", "true", "--checkpoint.interval", "5"]
    ref = train(1, [*SFT, *saved], dump=tmp_path / "ref")
    run = train(2, [*SFT, "--training.local_batch_size", "1"])  # each rank: 2 micro-batches of one sample
    assert "titanlite: chat data: " in ref.output
    assert_parity(ref.losses, run.losses)
    assert [s for s, _ in run.val_losses] == [s for s, _ in ref.val_losses] == [5, 10]
    for (_, a), (_, b) in zip(ref.val_losses, run.val_losses):
        assert abs(a - b) / a < 1e-6, (ref.val_losses, run.val_losses)
    assert ref.val_losses[1][1] < ref.val_losses[0][1] < ref.losses[0]  # the held-out chats' loss falls
    counts = {(r["chats_truncated"], r["chats_dropped"]) for r in ref.metrics + run.metrics}
    assert len(counts) == 1 and min(counts.pop()) > 0

    resumed = tmp_path / "resumed"
    shutil.copytree(ref.dump / "checkpoint" / "step-5", resumed / "checkpoint" / "step-5")
    again = train(1, [*SFT, *saved], dump=resumed)
    assert "resumed from" in again.output
    assert again.losses == ref.losses[5:] and again.val_losses == ref.val_losses[1:]
