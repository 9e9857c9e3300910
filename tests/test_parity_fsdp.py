"""FSDP2 and gradient accumulation reproduce a single-process run on the same global batch."""

import pytest
from harness import TINY, assert_eval_parity, assert_parity, blank_task, reference, train

GLOBAL8 = [*TINY, "--training.global_batch_size", "8"]
EXACT = ["--eval.tasks", f"stdlib_which,stdlib_signature,{blank_task()}", "--eval.interval", "10", "--eval.limit", "5",
         "--eval.max_new_tokens", "8"]
"""Scored at the last step: 20 multiple-choice requests, and 5 prompts of each exact-match task
generated (3 on rank 0 of 2, 2 on rank 0 of 4: uneven)."""


@pytest.mark.parametrize("nproc,local", [(2, 4), (4, 2)])
def test_fsdp_matches_single_process(nproc, local):
    ref = reference([*GLOBAL8, "--training.local_batch_size", "8", *EXACT])
    run = train(nproc, [*GLOBAL8, "--training.local_batch_size", str(local), *EXACT])
    assert_parity(ref.losses, run.losses)
    assert assert_eval_parity(ref, run) == 5
    assert_parity([r["grad_norm"] for r in ref.metrics], [r["grad_norm"] for r in run.metrics], 1e-5, 1e-3)


def test_grad_accumulation_two_micro_batches_match_one():
    one = reference(TINY)  # global 4 on one process: test_context_parallel's run, shared
    two = train(1, [*TINY, "--training.global_batch_size", "4", "--training.local_batch_size", "2"])
    assert_parity(one.losses, two.losses)


def test_grad_accumulation_across_world_sizes():
    ref = reference([*GLOBAL8, "--training.local_batch_size", "8", *EXACT])  # [eval] changes no loss
    run = train(2, [*GLOBAL8, "--training.local_batch_size", "2"])  # 2 ranks x 2 micro-batches x 2
    assert_parity(ref.losses, run.losses)


@pytest.mark.parametrize("layout", [["--training.local_batch_size", "4"],
                                    # no FSDP: autocast, with TP's inputs gathered in bf16
                                    ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]],
                         ids=["fsdp", "tp"])
def test_bf16_on_cpu_by_option_tracks_fp32(layout):
    ref = reference([*GLOBAL8, "--training.local_batch_size", "8", *EXACT])
    run = train(2, [*GLOBAL8, *layout, "--training.mixed_precision_param", "bfloat16"])
    # bf16 keeps ~3 significant digits: close to fp32, but not equal to it
    assert run.losses != ref.losses
    for a, b in zip(ref.losses, run.losses):
        assert abs(a - b) / a < 2e-2, (ref.losses, run.losses)
