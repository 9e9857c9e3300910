"""Launch the real trainer on N gloo ranks and read back what rank 0 logged.

Ranks get the environment torchrun would give them (RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT), without its agent. They are forked from a server process that has already
imported torch and titanlite: a fresh interpreter spends about five CPU seconds importing them,
and the suite starts a few hundred ranks on two cores. Each rank then runs its module or script
as `__main__`, as `python -m` would, with its own environment, working directory and log. A rank
that fails takes the others down at once, as torchrun does. A fresh interpreter per rank is
still tested: run_train.sh and plain torchrun start their ranks that way.

gloo ranks sometimes abort (SIGABRT) inside destroy_process_group() after all work is done.
A run counts as passed when every rank exits 0, or aborts with SIGABRT after writing its done
marker. Anything else fails.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from dataclasses import dataclass, field
from functools import cache
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
    codes: list[int] = field(default_factory=list)
    """Each rank's exit status (negative: killed by that signal)."""

    @property
    def rows(self) -> list[dict]:
        path = self.dump / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    @property
    def metrics(self) -> list[dict]:
        """Training rows (validation writes rows of its own)."""
        return [row for row in self.rows if "loss" in row]

    @property
    def line(self) -> dict[int, dict]:
        """The run's line: {step: its training row}, from the rows no restart or rollback
        superseded; there is one such row per step logged."""
        live = [row for row in self.metrics if not row.get("superseded")]
        steps = [row["step"] for row in live]
        assert len(steps) == len(set(steps)), f"two live rows for one step: {steps}"
        return {row["step"]: row for row in live}

    @property
    def val_losses(self) -> list[tuple[int, float]]:
        return [(row["step"], row["val_loss"]) for row in self.rows if "val_loss" in row]

    @property
    def losses(self) -> list[float]:
        return [row["loss"] for row in self.metrics]


@cache
def _scratch() -> str:
    """This process's folder for the tests' files, removed when it exits: a suite of runs leaves
    nothing behind in the system's temporary folder (CI's disk filled with a few thousand runs'
    dump folders). Ranks forked from this process run its exit handlers; only the owner removes."""
    folder, owner = tempfile.mkdtemp(prefix="titanlite-tests-"), os.getpid()
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(folder, ignore_errors=True))
    return folder


def scratch(prefix: str) -> Path:
    """A new empty folder in this session's scratch folder."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=_scratch()))


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore",
                "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", "")})
    env.update(extra or {})
    return env


FAIL_GRACE_S = 5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun gives each rank it starts on one node."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _done(dump: Path, rank: int) -> bool:
    return (dump / "status" / f"rank-{rank}.done").exists()


def _finished(run: Run, nproc: int) -> bool:
    """Every rank ended in 0, or in the teardown SIGABRT after writing its done marker."""
    return all(c == 0 or (c == -signal.SIGABRT and _done(run.dump, r)) for r, c in enumerate(run.codes))


# What a rank would import anyway; the fork server imports it once.
_PRELOAD = ["titanlite.train", "titanlite.dryrun.run", "torch.distributed.pipelining", "torch.distributed.checkpoint",
            "torch._inductor.compile_fx", "titanlite.models.transformers"]
_FORKS = multiprocessing.get_context("forkserver")
_started = False


def _fork_server_running() -> None:
    """Start the fork server with the ranks' base environment (OMP_NUM_THREADS among it is read
    when torch is imported) and this repository first on its path."""
    global _started
    if _started:
        return
    if sys.path[0] != str(REPO):
        sys.path.insert(0, str(REPO))
    saved = dict(os.environ)
    os.environ.update(_env(None))
    try:
        _FORKS.set_forkserver_preload(_PRELOAD)
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    _started = True


def _run_rank(cmd: list[str], env: dict[str, str], log: str) -> None:
    """Child side: become `python *cmd` with `env`, writing to `log`."""
    os.environ.clear()
    os.environ.update(env)
    # the fork server's warning filters came from its own PYTHONWARNINGS: take the rank's
    warnings.resetwarnings()
    warnings.simplefilter(env.get("PYTHONWARNINGS", "default"))  # type: ignore[arg-type]
    # runpy's note that the server preloaded the module it runs: this harness's doing, not the rank's
    warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package", RuntimeWarning)
    os.chdir(REPO)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        if cmd[0] == "-m":
            sys.argv = cmd[1:]
            runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(cmd)
            runpy.run_path(cmd[0], run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # a forked child skips interpreter shutdown, so run what it would


@dataclass
class Forked:
    """A forked rank, with the part of subprocess.Popen's interface the tests use."""
    proc: multiprocessing.process.BaseProcess

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank pid {self.proc.pid}", timeout)
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()

    def send_signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)


def fork_ranks(nproc: int, cmd: list[str], logs: list[Path], env: dict[str, str] | None = None) -> list[Forked]:
    """Start `python *cmd` as `nproc` ranks on a fresh local port, rank r writing to logs[r]."""
    _fork_server_running()
    port = free_port()
    procs = [_FORKS.Process(target=_run_rank, args=(cmd, _env({**rank_env(r, nproc, port), **(env or {})}),
                                                     str(logs[r]))) for r in range(nproc)]
    for p in procs:
        p.start()
    return [Forked(p) for p in procs]


def spawn_ranks(nproc: int, cmd: list[str], env: dict[str, str] | None = None, timeout: int = 600,
                dump: Path | None = None) -> tuple[list[int], str]:
    """Run `python *cmd` as `nproc` ranks; return their exit statuses and their output, rank by
    rank. Once a rank fails, the others get FAIL_GRACE_S to end on their own (to say their error
    too, or notice the lost peer), then are killed. With a dump folder, a SIGABRT after the
    rank's done marker is teardown, not failure."""
    logs = scratch("logs-")
    files = [logs / f"rank-{r}.log" for r in range(nproc)]
    procs = fork_ranks(nproc, cmd, files, env)

    def failed(r: int, code: int | None) -> bool:
        return code not in (None, 0) and not (code == -signal.SIGABRT and dump is not None and _done(dump, r))

    deadline, grace_end = time.monotonic() + timeout, None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if grace_end is None and any(failed(r, p.poll()) for r, p in enumerate(procs)):
                grace_end = now + FAIL_GRACE_S
            if grace_end is not None and now > grace_end:
                break
            if now > deadline:
                raise subprocess.TimeoutExpired(cmd, timeout)
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    output = "".join(f.read_text() for f in files if f.exists())
    shutil.rmtree(logs)
    return [p.poll() for p in procs], output


def launch(nproc: int, args: list[str], dump: Path | None = None, env: dict[str, str] | None = None,
           timeout: int = 600, module: str = "titanlite.train") -> Run:
    """Run `python -m titanlite.train` (or a test wrapper of it) on `nproc` ranks and return the
    outcome without judging it: returncode is the first failing rank's status, else 0."""
    dump = dump or scratch("run-")
    codes, output = spawn_ranks(nproc, ["-m", module, "--job.dump_folder", str(dump), *args],
                                env, timeout, dump)
    return Run(next((c for c in codes if c), 0), output, dump, codes)


def train(nproc: int, args: list[str], **kwargs) -> Run:
    """Launch and require success (tolerating only the known post-completion SIGABRT)."""
    run = launch(nproc, args, **kwargs)
    if run.returncode != 0 and not _finished(run, nproc):
        raise AssertionError(f"training on {nproc} rank(s) failed (exit {run.returncode}):\n{run.output[-6000:]}")
    assert run.metrics, f"no metrics written:\n{run.output[-3000:]}"
    return run


_REFERENCES: dict[tuple[str, ...], Run] = {}


def reference(args: list[str], env: dict[str, str] | None = None) -> Run:
    """Single-process run of the same job (and injected faults), shared by every test in the session."""
    key = (tuple(args), tuple(sorted((env or {}).items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = train(1, args, env=env)
    return _REFERENCES[key]


BUILTIN_EVAL = ["--eval.tasks", "stdlib_which,stdlib_doc_bpb", "--eval.interval", "5", "--eval.limit", "5",
                "--eval.batch_size", "3"]
"""[eval] on the built-in tasks: 20 multiple-choice requests and 5 texts, scored after steps 5 and 10."""


def blank_task() -> str:
    """An exact-match task file of 7 prompts whose answer is an empty first line: a prompt matches
    when its greedy generation's first line is blank. A model of 5 or 10 debug steps matches some
    and not others (built-in answers, whole signatures, it matches none), so a layout that
    generates other tokens or counts a prompt twice shows in exact_match."""
    prompts = [[f"def f{i}(x):\n    return x\n", f"import os\nx = f{i}(", f"    y = {i} +", f"class A{i}:\n"][i % 4]
               for i in range(7)]
    text = "".join(json.dumps({"prompt": p, "answer": ""}) + "\n" for p in prompts)
    # one file named by its content, not one per process: a test module's import writes it, in
    # multiprocessing's children too, which end without running exit handlers
    path = Path(tempfile.gettempdir()) / f"titanlite-blank-{zlib.crc32(text.encode()):08x}" / "blank.jsonl"
    if not path.exists():  # the task is named by the file: blank
        path.parent.mkdir(exist_ok=True)
        part = path.with_name(f"{path.name}.{os.getpid()}")
        part.write_text(text)
        os.replace(part, path)
    return str(path)


BUILTIN_EXACT = ["--eval.tasks", f"stdlib_which,stdlib_doc_bpb,{blank_task()}", *BUILTIN_EVAL[2:],
                 "--eval.max_new_tokens", "8"]
"""BUILTIN_EVAL and blank_task's first 5 prompts, 8 tokens generated for each."""


def eval_rows(run: Run) -> list[dict]:
    """Each evaluation's metrics (eval/<task>/<metric>), its time left out."""
    return [{k: v for k, v in row.items() if k.startswith("eval/") and k != "eval/seconds"}
            for row in run.rows if "eval/seconds" in row]


def assert_eval_parity(ref: Run, got: Run) -> int:
    """The same evaluations with the same metrics: accuracies identical, the rest (bits per byte,
    sums of log-likelihoods) to 1e-5 relative. Returns how many values were compared."""
    a_rows, b_rows = eval_rows(ref), eval_rows(got)
    assert a_rows and len(a_rows) == len(b_rows), (a_rows, b_rows)
    n = 0
    for a, b in zip(a_rows, b_rows):
        assert a.keys() == b.keys(), (a, b)
        for key in a:
            if "acc" in key or "exact_match" in key:
                assert a[key] == b[key], (key, a, b)
            else:
                assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (key, a, b)
            n += 1
    return n


def assert_parity(ref: list[float], got: list[float], first_rtol: float = 1e-6, rtol: float = 1e-4) -> None:
    """Loss parity, step by step; a step whose loss is NaN in both (an injected fault, skipped) matches."""
    assert len(ref) == len(got) and len(ref) >= 10, (ref, got)
    first = abs(got[0] - ref[0]) / abs(ref[0])
    assert first <= first_rtol, f"first-step loss {got[0]!r} vs {ref[0]!r}: rel diff {first:.2e} > {first_rtol}"
    for step, (a, b) in enumerate(zip(ref, got), start=1):
        if a != a and b != b:
            continue
        rel = abs(a - b) / abs(a)
        assert rel <= rtol, f"step {step}: loss {b!r} vs {a!r}: rel diff {rel:.2e} > {rtol}"


def assert_grad_parity(model: str, nproc: int, args: list[str]) -> None:
    """Every full gradient of one parallel step matches the unsharded model's.

    Loss curves barely feel small replicated weights (norms): a gradient left unreduced
    across tensor-parallel ranks can pass loss parity and still be wrong.
    """
    codes, output = spawn_ranks(nproc, [str(REPO / "tests" / "grad_parity.py"), model, *args],
                                timeout=300)
    layouts = args.count("+") + 1  # several layouts can share one launch
    assert output.count("worst relative diff") == nproc * layouts and "MISMATCH" not in output, \
        (codes, output[-6000:])
