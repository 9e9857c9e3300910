"""Downstream evaluation: tasks (multiple choice, bits per byte, exact match) scored in the
training loop on the training layout (titanlite.eval.score), and the lm-eval model class behind
`python -m titanlite.eval` (titanlite.eval.harness). Training imports only tasks and score."""
