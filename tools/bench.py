"""Throughput benchmark: `python -m titanlite.tools.bench --config X [bench flags] [--section.key value ...]`.

Runs the real trainer for warm-up + N steps and reports, over the N timed steps only,
ms/step, tokens/s per device, MFU and peak memory, as a table and as JSON. MFU is taken
against the datasheet peak on known GPUs and against the dense matmul rate this run
measures for the training dtype on CPU (and reported next to it on GPU).

Bench flags:
  --ngpu N          ranks to launch with torchrun (default 1); or start the bench under torchrun
  --warmup W        untimed steps first (default 3)
  --steps N         timed steps (default 10)
  --peer            also train the same shape as a transformers LlamaForCausalLM in a plain
                    PyTorch loop (DDP when N > 1), same batch, dtype and threads; print ratios
  --torchtitan      also run torchtitan on the same model, layout and batch (CUDA machines with
                    torchtitan installed; skipped with a note otherwise)
  --repeat R        run titanlite (and the peer) R times, alternating, and keep each one's fastest
                    run: on a shared machine this filters out the slices where others took the cores
  --track-memory    record the peak of allocated tensor bytes with the PyTorch profiler (slows steps)
  --out FILE        JSON output (default <job.dump_folder>/bench.json)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.config import load as config_load
from titanlite.config.job import JobConfig
from titanlite.errors import ConfigError
from titanlite.metrics import device_peak_flops, peak_memory_gib
from titanlite.preflight import param_dtype, preflight

BENCH_FLAGS = {"--ngpu": int, "--repeat": int, "--warmup": int, "--steps": int, "--out": str, "--_role": str, "--_result": str}
BENCH_SWITCHES = ("--peer", "--torchtitan", "--track-memory")


@dataclass
class BenchArgs:
    ngpu: int = 1
    warmup: int = 3
    steps: int = 10
    repeat: int = 1
    out: str = ""
    peer: bool = False
    torchtitan: bool = False
    track_memory: bool = False
    role: str = ""
    """Internal: the role of a launched worker (titanlite or peer)."""
    result: str = ""
    """Internal: where a launched worker writes its result."""


def parse_args(argv: list[str]) -> tuple[BenchArgs, list[str]]:
    """Split bench flags from trainer overrides (which config_load.load checks)."""
    args, rest, i = BenchArgs(), [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in BENCH_SWITCHES:
            setattr(args, name[2:].replace("-", "_"), True)
        elif name in BENCH_FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{name} needs a value")
                i, value = i + 1, argv[i + 1]
            try:
                setattr(args, name[2:].lstrip("_"), BENCH_FLAGS[name](value))
            except ValueError:
                raise ConfigError(f"{name}: expected {BENCH_FLAGS[name].__name__}, got '{value}'") from None
        else:
            rest.append(argv[i])
        i += 1
    if min(args.ngpu, args.warmup, args.steps, args.repeat) < 1:
        raise ConfigError("--ngpu, --warmup, --steps and --repeat must be >= 1")
    return args, rest


def trainer_argv(args: BenchArgs, rest: list[str], dump: str | None) -> list[str]:
    """The user's overrides, then the bench's: log exactly at the end of warm-up and of the run."""
    argv = [*rest, "--training.steps", str(args.warmup + args.steps), "--metrics.log_freq", str(args.warmup),
            "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "0", "--validation.freq", "0"]
    return argv if dump is None else [*argv, "--job.dump_folder", dump]


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """Best-of dense matmul FLOP/s for this process (its threads, its device, the training dtype)."""
    n = 1024 if device.type == "cpu" else 8192
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(8):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / 4)
    return 2 * n**3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def tensor_memory_peak(enabled: bool, out: dict):
    """Peak of allocated tensor bytes on this process, from the profiler's allocator events
    (which, unlike RSS, see frees and FSDP's storage resizes at once)."""
    if not enabled:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield
    out["tensor_peak_gib"] = _peak_bytes(prof.profiler.kineto_results.experimental_event_tree(), out["device"]) / 2**30


def _peak_bytes(roots: list, device: str) -> int:
    """Replay allocations and frees in time order, leaving out the scratch copies gloo makes
    inside collectives: NCCL makes none, and gloo's worker thread, which the profiler does not
    see, often frees them, so counting them would leak their bytes at random. That thread can
    also drop the last reference to a tensor the main thread allocated (a reduce-scatter input);
    an address allocated again proves the block that lived there was freed unseen."""
    from torch._C._profiler import _ExtraFields_Allocation

    events, stack = [], [(node, False) for node in roots]
    while stack:
        node, in_collective = stack.pop()
        fields = node.extra_fields
        if isinstance(fields, _ExtraFields_Allocation) and str(fields.device).startswith(device):
            events.append((node.start_time_ns, fields.ptr, fields.alloc_size, in_collective))
        in_collective = in_collective or node.name.startswith(("c10d::", "gloo:"))
        stack.extend((child, in_collective) for child in node.children)
    scratch: set[int] = set()
    held: dict[int, int] = {}  # address -> bytes of the counted block living there
    live = peak = 0
    for _, ptr, nbytes, in_collective in sorted(events, key=lambda e: e[0]):
        if nbytes > 0:
            scratch.discard(ptr)  # a scratch copy that lived here was freed unseen
            live -= held.pop(ptr, 0)  # so was a counted block
            if in_collective:
                scratch.add(ptr)
            else:
                held[ptr] = nbytes
                live += nbytes
        elif ptr in scratch:
            scratch.discard(ptr)
        elif ptr in held:
            live -= held.pop(ptr)
        peak = max(peak, live)
    return peak


def _timed_window(rows: list[dict], warmup: int, tokens_per_step: float) -> float:
    """Seconds spent in the steps after warm-up, rebuilt from the logged tokens/s intervals."""
    seconds, prev = 0.0, 0
    for row in rows:
        if row["step"] > warmup:
            seconds += (row["step"] - prev) * tokens_per_step / row["tokens_per_sec"]
        prev = row["step"]
    return seconds


def run_titanlite(args: BenchArgs, rest: list[str]) -> dict | None:
    """Train under the real trainer; returns rank 0's result (None on other ranks)."""
    from titanlite import train
    from titanlite.parallel.mesh import pick_device
    from titanlite.runtime import console

    dump = tempfile.mkdtemp(prefix="titanlite-bench-")
    cfg, _ = config_load.load(trainer_argv(args, rest, dump))
    plan = preflight(cfg, config_load.world_size())
    device = pick_device(cfg.training.device)
    dtype = param_dtype(cfg.training.mixed_precision_param, device)
    rate = matmul_rate(device, dtype)
    mem: dict = {"device": device.type}
    with tensor_memory_peak(args.track_memory, mem):
        try:
            train.train(cfg, plan)
        finally:
            console.restore()  # what the bench says next belongs on the console
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {"matmul_flops": rate, **mem})
    if dist.get_rank():  # every rank made a dump folder of its own
        shutil.rmtree(dump, ignore_errors=True)
        return None
    rows = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "tokens_per_sec" in row]  # training rows only
    shutil.rmtree(dump, ignore_errors=True)
    tokens_per_step = plan.global_batch_size * cfg.training.seq_len / dist.get_world_size()
    seconds = _timed_window(rows, args.warmup, tokens_per_step)
    flops_per_token = plan.spec.flops_per_token(plan.args, cfg.training.seq_len)
    result = _summary("titanlite", cfg, plan, args, seconds, tokens_per_step, flops_per_token,
                      device, per_rank, rows[-1]["peak_gib"])
    result["final_loss"] = rows[-1]["loss"]
    return result


def _summary(name: str, cfg: JobConfig, plan, args: BenchArgs, seconds: float, tokens_per_step: float,
             flops_per_token: float, device: torch.device, per_rank: list[dict], peak_gib: float) -> dict:
    tps = args.steps * tokens_per_step / seconds
    measured = sum(r["matmul_flops"] for r in per_rank) / len(per_rank)
    peak = device_peak_flops(device) if device.type == "cuda" else measured
    result = {
        "name": name, "model": f"{cfg.model.name} {cfg.model.variant}", "layout": str(plan.dims),
        "world_size": len(per_rank), "device": _device_name(device), "dtype": str(param_dtype(cfg.training.mixed_precision_param, device)).removeprefix("torch."),
        "threads": torch.get_num_threads(), "global_batch_size": plan.global_batch_size,
        "local_batch_size": cfg.training.local_batch_size, "seq_len": cfg.training.seq_len,
        "warmup_steps": args.warmup, "timed_steps": args.steps,
        "ms_per_step": 1000 * seconds / args.steps, "tokens_per_sec_per_device": tps,
        "flops_per_token": flops_per_token, "matmul_tflops_measured": measured / 1e12,
        "mfu_basis": "datasheet" if device.type == "cuda" else "measured matmul",
        "mfu_pct": None if peak is None else 100 * tps * flops_per_token / peak,
        "peak_memory_gib": peak_gib,
        "peak_memory_kind": "max allocated (CUDA)" if device.type == "cuda" else "peak RSS, rank 0",
    }
    if "tensor_peak_gib" in per_rank[0]:
        result["tensor_peak_gib_per_rank"] = [r["tensor_peak_gib"] for r in per_rank]
    return result


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu x{torch.get_num_threads()} thread(s)"


def launch(role: str, args: BenchArgs, rest: list[str]) -> dict:
    """Run one role in fresh processes (so peak memory is its own) and read back its result."""
    result = Path(tempfile.mkdtemp(prefix="titanlite-bench-")) / f"{role}.json"
    flags = ["--warmup", str(args.warmup), "--steps", str(args.steps), "--_role", role, "--_result", str(result)]
    if args.track_memory:
        flags.append("--track-memory")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ngpu}",
           "-m", "titanlite.tools.bench", *flags, *rest]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    # gloo can abort in teardown after the work is done: the result file is the proof of success
    if not result.exists():
        sys.exit(f"titanlite: error: bench {role} run failed (exit {proc.returncode}):\n"
                 f"{(proc.stdout + proc.stderr)[-4000:]}")
    data = json.loads(result.read_text())
    shutil.rmtree(result.parent, ignore_errors=True)
    return data


def run_peer(args: BenchArgs, rest: list[str]) -> dict | None:
    """The transformers peer on the same job; returns rank 0's result (None on other ranks)."""
    from titanlite.parallel.mesh import init_process_group, pick_device
    from titanlite.tools.bench_peer import time_peer

    cfg, _ = config_load.load(trainer_argv(args, rest, None))
    plan = preflight(cfg, config_load.world_size())
    device = pick_device(cfg.training.device)
    dtype = param_dtype(cfg.training.mixed_precision_param, device)
    rate = matmul_rate(device, dtype)
    init_process_group(device, cfg.comm.init_timeout_s)
    seconds = time_peer(args, cfg, plan, device, dtype)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {"matmul_flops": rate})
    if dist.get_rank():
        return None
    tokens_per_step = plan.global_batch_size * cfg.training.seq_len / dist.get_world_size()
    flops = plan.spec.flops_per_token(plan.args, cfg.training.seq_len)
    return _summary("transformers", cfg, plan, args, seconds, tokens_per_step, flops, device, per_rank,
                    peak_memory_gib(device))


def worker(args: BenchArgs, rest: list[str]) -> dict | None:
    try:
        return run_peer(args, rest) if args.role == "peer" else run_titanlite(args, rest)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def print_table(results: list[dict]) -> None:
    cols = [("name", "run", "{}"), ("ms_per_step", "ms/step", "{:.1f}"),
            ("tokens_per_sec_per_device", "tok/s/dev", "{:,.0f}"), ("mfu_pct", "MFU %", "{:.1f}"),
            ("peak_memory_gib", "peak GiB", "{:.3f}")]
    print(f"{results[0]['model']}, {results[0]['layout']}, {results[0]['device']}, "
          f"batch {results[0]['local_batch_size']}x{results[0]['seq_len']}/rank, "
          f"matmul {results[0]['matmul_tflops_measured'] * 1e3:.1f} GFLOP/s measured "
          f"(MFU vs {results[0]['mfu_basis']})")
    print("  ".join(f"{h:>12}" for _, h, _ in cols))
    for r in results:
        print("  ".join(f"{'-' if r.get(k) is None else f.format(r[k]):>12}" for k, _, f in cols))
    base = results[0]
    for other in results[1:]:
        ratio = base["tokens_per_sec_per_device"] / other["tokens_per_sec_per_device"]
        print(f"titanlite / {other['name']}: tokens/s x{ratio:.2f}, "
              f"peak memory x{base['peak_memory_gib'] / other['peak_memory_gib']:.2f}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    try:
        args, rest = parse_args(argv)
        if args.role or "WORLD_SIZE" in os.environ:
            # a worker (launched by this module, or by the user under torchrun)
            result = worker(args, rest)
            if result is not None and args.result:
                Path(args.result).write_text(json.dumps(result))
            elif result is not None:
                print_table([result])
            return
        cfg, _ = config_load.load(trainer_argv(args, rest, None))
        plan = preflight(cfg, args.ngpu)  # bad input fails here, before any launch
        if args.peer and (plan.dims.tp > 1 or plan.dims.cp > 1):
            raise ConfigError("--peer compares data-parallel layouts only; drop tp/cp degrees")
    except ConfigError as e:
        sys.exit(f"titanlite: error: {e}")
    roles = ["titanlite", "peer"] if args.peer else ["titanlite"]
    runs: dict[str, list[dict]] = {role: [] for role in roles}
    for _ in range(args.repeat):
        for role in roles:
            runs[role].append(launch(role, args, rest))
    results = [max(runs[role], key=lambda r: r["tokens_per_sec_per_device"]) for role in roles]
    for role, result in zip(roles, results):
        result["repeats_tokens_per_sec"] = [r["tokens_per_sec_per_device"] for r in runs[role]]
    if args.torchtitan:
        from titanlite.tools.bench_peer import run_torchtitan

        tt = run_torchtitan(args, cfg, plan)
        if tt is not None:
            results.append({**results[0], **tt})
    print_table(results)
    out = Path(args.out or Path(cfg.job.dump_folder) / "bench.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "command": " ".join(["python -m titanlite.tools.bench", *argv]),
              "torch": torch.__version__, "python": sys.version.split()[0], "results": results}
    if args.peer:
        import transformers

        record["transformers"] = transformers.__version__
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
