"""An in-loop evaluation's memory (`[eval]`, titanlite.eval.score), traced by the dry run beside
the training step: one forward of eval.batch_size rows of training.seq_len tokens under no_grad,
as the loop's log-likelihood tasks run it (the step's eval_logprobs, the model in eval mode),
after the optimizer step and zero_grad (the gradients are gone; weights, buffers and optimizer
state stay).

Its peak per rank is what stays (the training step's parameters and optimizer state at the
model's depth) plus the most this forward holds at once beyond it. Without autograd no block
keeps its activations for a backward, so that transient does not grow with depth and the dry
run's shallow model (a block of each kind) shows it. Exact-match tasks generate instead (their
cache: `--generate BATCHxCONTEXT`); they are not counted.
"""

from __future__ import annotations

import torch

from titanlite.dryrun.steptrace import StepTracer


def eval_transient(tracer: StepTracer, step, batch: dict, parts: list[torch.nn.Module]) -> int:
    """The bytes one evaluation forward of `batch` holds at its peak beyond what exists before it,
    traced on fake tensors by the training step's `tracer` once its step is replayed: it knows
    every storage the step made, FSDP's unsharded parameters (resized to nothing between their
    gathers) among them."""
    start = len(tracer.log)
    for part in parts:
        part.eval()
    try:
        with tracer, torch.no_grad():
            step.eval_logprobs(batch)  # its result freed at once, as the loop's sums are taken
    finally:
        for part in parts:
            part.train()
    live = peak = 0
    for _, _, delta in tracer.log[start:]:
        live += delta or 0
        peak = max(peak, live)
    return peak
