"""One real training step on a fake process group with fake tensors, at any scale: the trace
(steptrace), its replay over depth (blocktrace) and micro-batches (pptrace), GPU figures and
the step-time model (hardware), and the command (run; `python -m titanlite.dryrun`)."""
