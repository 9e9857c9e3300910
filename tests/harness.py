"""Launch the real trainer on N gloo ranks and read back what rank 0 logged.

gloo ranks sometimes abort (SIGABRT) inside destroy_process_group() after all work
is done, and torchrun then SIGTERMs the ranks still tearing down. A run counts as passed
when torchrun exits 0, or when every rank wrote its done marker and the child failures
are SIGABRT, plus possibly those SIGTERMs. Anything else fails.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# A tiny, fast job: debug model, short sequences, every step logged, no TensorBoard.
TINY = ["--model.flavor", "debugmodel", "--training.seq_len", "64", "--training.local_batch_size", "4",
        "--training.steps", "10", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2",
        "--metrics.enable_tensorboard", "false", "--data.holdout_fraction", "0.0"]


@dataclass
class Run:
    returncode: int
    output: str
    dump: Path

    @property
    def rows(self) -> list[dict]:
        path = self.dump / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    @property
    def metrics(self) -> list[dict]:
        """Training rows (validation writes rows of its own)."""
        return [row for row in self.rows if "loss" in row]

    @property
    def val_losses(self) -> list[tuple[int, float]]:
        return [(row["step"], row["val_loss"]) for row in self.rows if "val_loss" in row]

    @property
    def losses(self) -> list[float]:
        return [row["loss"] for row in self.metrics]


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore",
                "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", "")})
    env.update(extra or {})
    return env


def _finished(run: Run, nproc: int) -> bool:
    done = all((run.dump / "status" / f"rank-{r}.done").exists() for r in range(nproc))
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", run.output)
    return done and "-6" in codes and all(c in ("-6", "-15") for c in codes)


def launch(nproc: int, args: list[str], dump: Path | None = None, env: dict[str, str] | None = None,
           timeout: int = 600, module: str = "titanlite.train") -> Run:
    """Run `torchrun -m titanlite.train` (or a test wrapper of it) and return the outcome without judging it."""
    dump = dump or Path(tempfile.mkdtemp(prefix="titanlite-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", module, "--job.dump_folder", str(dump), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(env), timeout=timeout, cwd=REPO)
    return Run(proc.returncode, proc.stdout + proc.stderr, dump)


def train(nproc: int, args: list[str], **kwargs) -> Run:
    """Launch and require success (tolerating only the known post-completion SIGABRT)."""
    run = launch(nproc, args, **kwargs)
    if run.returncode != 0 and not _finished(run, nproc):
        raise AssertionError(f"training on {nproc} rank(s) failed (exit {run.returncode}):\n{run.output[-6000:]}")
    assert run.metrics, f"no metrics written:\n{run.output[-3000:]}"
    return run


_REFERENCES: dict[tuple[str, ...], Run] = {}


def reference(args: list[str]) -> Run:
    """Single-process run of the same job, shared by every test in the session."""
    key = tuple(args)
    if key not in _REFERENCES:
        _REFERENCES[key] = train(1, args)
    return _REFERENCES[key]


def assert_parity(ref: list[float], got: list[float], first_rtol: float = 1e-6, rtol: float = 1e-4) -> None:
    assert len(ref) == len(got) and len(ref) >= 10, (ref, got)
    first = abs(got[0] - ref[0]) / abs(ref[0])
    assert first <= first_rtol, f"first-step loss {got[0]!r} vs {ref[0]!r}: rel diff {first:.2e} > {first_rtol}"
    for step, (a, b) in enumerate(zip(ref, got), start=1):
        rel = abs(a - b) / abs(a)
        assert rel <= rtol, f"step {step}: loss {b!r} vs {a!r}: rel diff {rel:.2e} > {rtol}"


def assert_grad_parity(model: str, nproc: int, args: list[str]) -> None:
    """Every full gradient of one parallel step matches the unsharded model's.

    Loss curves barely feel small replicated weights (norms): a gradient left unreduced
    across tensor-parallel ranks can pass loss parity and still be wrong.
    """
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           str(REPO / "tests" / "grad_parity.py"), model, *args],
                          capture_output=True, text=True, env=_env(None), cwd=REPO, timeout=300)
    layouts = args.count("+") + 1  # several layouts can share one launch
    assert proc.stdout.count("worst relative diff") == nproc * layouts and "MISMATCH" not in proc.stdout, \
        proc.stdout[-3000:] + proc.stderr[-3000:]
