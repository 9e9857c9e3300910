"""Health check before a long run: this node's GPUs, links and numerics against the datasheet and
the dry run. `python -m titanlite.tools.healthcheck [flags] [--config X --section.key value ...]`,
or `./run_train.sh --healthcheck ...`, which runs it on every node (NNODES, NODE_RANK and
RDZV_ENDPOINT as for a job).

On one process per GPU (torchrun, NCCL; on a CPU machine gloo ranks at tiny sizes):
- facts: GPUs (name, count, memory), driver, torch, CUDA, NCCL;
- per GPU: the bf16 matmul rate and memory bandwidth (a device copy) against the figures the dry
  run uses (titanlite.dryrun.hardware: the part's best measured matmul rate, its datasheet HBM)
  and against the node's median; a GPU below --min-share of the median or --min-datasheet-share
  of the datasheet is named and fails; on a CPU (no GPU found: said in the first line) the fp32
  rates are judged against fixed floors (CPU_FLOORS) instead, since the ranks share cores whose
  load, not a fault, sets how they compare;
- collectives: all-reduce and all-gather bus bandwidth in the node (and over all nodes) against
  the step-time model's link figures (NVLink or the per-GPU network, at NCCL's efficiency);
- numerics: the debug Llama's first 5 losses in fp32 on each GPU against the host CPU (within
  1e-4), and in bf16 (within 2% of the fp32 loss);
- features: compile, float8, flex attention (forward + backward against sdpa), varlen;
- a short run of the job (the config given, else llama3 1B with selective AC on this node; on
  CPU the debug model at seq 64) for --warmup + --steps steps: tokens/s per GPU, MFU and peak
  memory next to the dry run's prediction for this GPU at the power limit its driver enforces
  (nvidia-smi's power.limit; n/a on a CPU), with the error in percent; it fails when tokens/s
  fall more than --tolerance below the prediction.
A table at the end, --out FILE (JSON), exit 1 when anything fails, 2 on bad input.

Flags: --ngpu N (default: the CUDA GPUs here, else 2 gloo ranks), --warmup W (3), --steps N (5),
--min-share (0.9), --min-datasheet-share (0.7), --tolerance (0.25), --skip-run, --out FILE.
Tests inject faults with TITANLITE_HEALTH_INJECT="slow_matmul:RANK,bad_numerics:RANK".
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.dryrun import hardware, timing
from titanlite.dryrun.run import split_flags
from titanlite.errors import ConfigError

# the datasheet comparison needs the part the figures are for: PCIe/NVL boards of the same name
# run at other clocks and links, so they get none (n/a) rather than a wrong bar
_PARTS = {"H100": "h100", "H200": "h200", "A100-SXM4-80GB": "a100", "B200": "b200"}
FP32_BOUND = 1e-4
BF16_BAND = 0.02
CPU_FLOORS = {"matmul_tflops": 0.005, "membw_gbps": 2.0}
"""A CPU rank's bars: about a tenth of what a shared 2-core machine measures under load (70 GFLOP/s
fp32 matmul, 47 GB/s copies quiet); below them the machine is broken or throttled, not busy."""
CPU_RUN = ["--model.flavor", "debugmodel", "--training.seq_len", "64", "--training.local_batch_size", "2",
           "--data.holdout_fraction", "0.0"]
GPU_RUN = ["--config", "llama_1b.toml", "--activation_checkpoint.mode", "selective"]


def datasheet(name: str) -> hardware.GPU | None:
    """The dry run's figures for a CUDA device name, or None for a part it has none for."""
    if any(word in name for word in ("PCIe", "NVL")):
        return None
    return next((hardware.GPUS[v] for k, v in _PARTS.items() if k in name), None)


def _inject() -> dict[str, set[int]]:
    spec = os.environ.get("TITANLITE_HEALTH_INJECT", "")
    out: dict[str, set[int]] = {"slow_matmul": set(), "bad_numerics": set()}
    for item in filter(None, spec.split(",")):
        kind, _, rank = item.partition(":")
        if kind not in out or not rank.isdigit():
            raise ConfigError(f"TITANLITE_HEALTH_INJECT: bad item '{item}'; expected slow_matmul:RANK or bad_numerics:RANK")
        out[kind].add(int(rank))
    return out


def power_limit_w() -> float | None:
    """GPU 0's enforced power limit in watts, as the driver reports it (nvidia-smi), or None
    (no NVIDIA driver here: a CPU, or a machine without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=power.limit", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=20).stdout.split()
        return float(out[0])
    except (OSError, IndexError, ValueError, subprocess.TimeoutExpired):
        return None


def facts(device: torch.device) -> dict:
    f = {"host": socket.gethostname(), "torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        f |= {"gpu": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
              "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
              "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
        try:
            f["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=20).stdout.split()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            f["driver"] = "unknown (no nvidia-smi)"
    else:
        f |= {"gpu": "none (CPU, gloo)", "threads": torch.get_num_threads()}
    return f


def run_checks() -> dict:
    """One rank's part (under torchrun); every rank returns the whole world's results."""
    from titanlite.parallel.mesh import init_process_group, pick_device
    from titanlite.tools import health_checks as hc

    inject = _inject()
    device = pick_device("auto")
    init_process_group(device, 600)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    dist.barrier()  # every rank measures at once: a node's GPUs share its host, a CPU's ranks its memory
    mine = {"rank": rank, "node": rank // local, **facts(device), **hc.device_rates(device)}
    if rank in inject["slow_matmul"]:
        mine["matmul_tflops"] *= 0.01  # the test double of a broken device's measurement
    host = hc.tiny_losses(torch.device("cpu"))
    dev = list(host) if device.type == "cpu" else hc.tiny_losses(device)  # the host's run is the CPU's
    if rank in inject["bad_numerics"]:
        dev = [x + 1e-3 for x in dev]
    mine["numerics"] = {"host_fp32": host, "device_fp32": dev, "device_bf16": hc.tiny_losses(device, torch.bfloat16)}
    if rank % local == 0:
        mine["features"] = hc.features(device)
    nodes = [dist.new_group(list(range(n * local, (n + 1) * local))) for n in range(world // local)]
    comms = {}
    for kind in ("all_reduce", "all_gather"):
        if local > 1:
            comms[f"{kind} node"] = hc.bus_bandwidth(kind, device, nodes[rank // local])
        if world > local:
            comms[f"{kind} world"] = hc.bus_bandwidth(kind, device, None)
    mine["collectives"] = comms
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    dist.barrier()
    dist.destroy_process_group()
    return {"ranks": everyone, "world_size": world, "local_world_size": local}


def _row(check: str, status: str, measured: str, reference: str = "", note: str = "") -> dict:
    return {"check": check, "status": status, "measured": measured, "reference": reference, "note": note}


def assess(checks: dict, run: dict | None, pred: dict | None, opts: dict, run_error: str = "",
           pred_error: str = "") -> list[dict]:
    """PASS/FAIL/SKIP/INFO rows from the figures (pure: the tests feed it doubles)."""
    ranks, rows = checks["ranks"], []
    cpu = ranks[0]["gpu"].startswith("none")
    gpu = None if cpu else datasheet(ranks[0]["gpu"])
    for key, unit, ref in (("matmul_tflops", "TFLOPS", gpu and gpu.mamf_flops / 1e12),
                           ("membw_gbps", "GB/s", gpu and gpu.hbm_bytes_per_s / 1e9)):
        for node in sorted({r["node"] for r in ranks}):
            mates = [r for r in ranks if r["node"] == node]
            median = statistics.median(r[key] for r in mates)
            for r in mates:
                share, reference = r[key] / median, f"median {median:,.4g}"
                if cpu:  # ranks sharing busy cores differ by load: a fixed floor judges each
                    floor = CPU_FLOORS[key]
                    bad = [f"below the CPU floor of {floor:g} {unit}"] if r[key] < floor else []
                    reference += f"; CPU floor {floor:g}"
                else:
                    bad = ([f"{share:.1%} of the node median, below --min-share {opts['min_share']:.0%}"]
                           if share < opts["min_share"] else [])
                if ref:
                    reference += f"; datasheet {ref:,.0f} ({r[key] / ref:.0%})"
                    if r[key] / ref < opts["min_datasheet_share"]:
                        bad.append(f"{r[key] / ref:.1%} of the datasheet, below --min-datasheet-share "
                                   f"{opts['min_datasheet_share']:.0%}")
                note = "; ".join(bad) if bad else ("" if ref else "datasheet: n/a on this device")
                rows.append(_row(f"{key.split('_')[0]} rank {r['rank']} ({r['host']})", "FAIL" if bad else "PASS",
                                 f"{r[key]:,.4g} {unit}", reference, note))
    for name in sorted({k for r in ranks for k in r["collectives"]}):
        worst = min(r["collectives"][name] for r in ranks if name in r["collectives"])
        if gpu is None:
            rows.append(_row(f"{name} bus bandwidth", "INFO", f"{worst:,.2f} GB/s", "n/a on this device"))
            continue
        link = "nvlink" if name.endswith("node") else "network"
        link_bw = (gpu.nvlink_bytes_per_s if link == "nvlink" else gpu.network_bytes_per_s) / 1e9
        ref = link_bw * timing.LINK_EFFICIENCY[link]
        bad = worst / ref < opts["min_datasheet_share"]
        rows.append(_row(f"{name} bus bandwidth", "FAIL" if bad else "PASS", f"{worst:,.1f} GB/s",
                         f"{link} {ref:,.0f} ({worst / ref:.0%})",
                         "slowest rank" + (f": {worst / ref:.1%} of the link, below --min-datasheet-share "
                                           f"{opts['min_datasheet_share']:.0%}" if bad else "")))
    if not any("collectives" in r and r["collectives"] for r in ranks):
        rows.append(_row("collectives", "SKIP", "-", note="one rank: nothing to measure"))
    for r in ranks:
        n = r["numerics"]
        fp32 = max(abs(a - b) for a, b in zip(n["device_fp32"], n["host_fp32"]))
        bf16 = max(abs(a - b) / b for a, b in zip(n["device_bf16"], n["host_fp32"]))
        same = " (the device is the host)" if r["gpu"].startswith("none") else ""
        rows.append(_row(f"numerics fp32 rank {r['rank']}", "PASS" if fp32 <= FP32_BOUND else "FAIL",
                         f"max |loss - host| {fp32:.1e}", f"<= {FP32_BOUND:.0e}", "first 5 losses" + same
                         + ("" if fp32 <= FP32_BOUND else f": {fp32:.1e} is over the bound {FP32_BOUND:.0e}")))
        rows.append(_row(f"numerics bf16 rank {r['rank']}", "PASS" if bf16 <= BF16_BAND else "FAIL",
                         f"max relative {bf16:.1e}", f"<= {BF16_BAND:.0%} of fp32",
                         "" if bf16 <= BF16_BAND else f"{bf16:.1%} of the fp32 loss, over the bound {BF16_BAND:.0%}"))
    for r in ranks:
        for name, (status, why) in r.get("features", {}).items():
            rows.append(_row(f"feature {name} (node {r['node']})", status, "", "", why))
    rows += run_rows(run, pred, opts, run_error, pred_error)
    return rows


def run_rows(run: dict | None, pred: dict | None, opts: dict, run_error: str = "", pred_error: str = "",
             name: str = "job") -> list[dict]:
    """The job run's figures next to the dry run's; FAIL when tokens/s fall short by more than the tolerance."""
    if opts["skip_run"]:
        return [_row(f"{name} run", "SKIP", "-", note="--skip-run")]
    if run is None:
        return [_row(f"{name} run", "FAIL", "-", note=run_error)]
    what = f"{run['model']}, {run['layout']}, batch {run['local_batch_size']}x{run['seq_len']}"
    mfu = "-" if run["mfu_pct"] is None else f"{run['mfu_pct']:.1f}%"
    if pred is None:
        note = pred_error or "no prediction: the dry run has no figures for this device (power limit: n/a)"
        return [_row(f"{name} tokens/s/device ({what})", "INFO", f"{run['tokens_per_sec_per_device']:,.0f}", "", note),
                _row(f"{name} MFU", "INFO", mfu, "", note),
                _row(f"{name} peak memory", "INFO", f"{run['peak_memory_gib']:.2f} GiB", "", note)]
    p = pred["predicted"]
    peak = max(r["memory_gib"]["peak"] for r in pred["roles"])
    err = run["tokens_per_sec_per_device"] / p["tokens_per_sec_per_gpu"] - 1
    slow = opts["tolerance"] is not None and err < -opts["tolerance"]
    status = "INFO" if opts["tolerance"] is None else "FAIL" if slow else "PASS"  # None: figures, no judgement
    # the GPU the prediction is for, at the power limit the driver enforces (its sustained clocks)
    at = f" on {p['gpu']} at {p['power_w']:.0f} W" if "power_w" in p else ""
    return [_row(f"{name} tokens/s/GPU ({what})", status, f"{run['tokens_per_sec_per_device']:,.0f}",
                 f"dry run {p['tokens_per_sec_per_gpu']:,.0f}{at} ({err:+.1%})",
                 f"more than {opts['tolerance']:.0%} below the prediction" if slow else ""),
            _row(f"{name} MFU", "INFO", mfu, f"dry run {p['mfu_pct']:.1f}%"),
            _row(f"{name} peak memory", "INFO", f"{run['peak_memory_gib']:.2f} GiB",
                 f"dry run {peak:.2f} GiB ({run['peak_memory_gib'] / peak - 1:+.1%})")]


def start_dry_run(gpu: hardware.GPU | None, ngpu: int, run_argv: list[str], out: Path,
                  power_w: float | None = None) -> subprocess.Popen | None:
    """The dry run's prediction of the job on `gpu` at the power limit the driver enforces, on
    the host's CPU beside the GPU work."""
    if gpu is None:
        return None
    power = [] if power_w is None else ["--power-limit", f"{power_w:g}"]
    return subprocess.Popen([sys.executable, "-m", "titanlite.dryrun", "--ngpu", str(ngpu), "--gpu", gpu.name,
                             *power, "--out", str(out), *run_argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish_dry_run(dry: subprocess.Popen | None, out: Path) -> tuple[dict | None, str]:
    """(the dry run's report, or None with why)."""
    if dry is None:
        return None, ""
    text = dry.communicate()[0]
    if out.exists():
        return json.loads(out.read_text()), ""
    return None, f"dry run failed: {_one_line(text)}"


def job_run(ngpu: int, warmup: int, steps: int, run_argv: list[str]) -> tuple[dict | None, str]:
    """The job for warmup + steps steps on this node (titanlite.tools.bench): (its figures, or None with why)."""
    from titanlite.tools.bench import BenchArgs, launch

    try:
        return launch("titanlite", BenchArgs(ngpu=ngpu, warmup=warmup, steps=steps), run_argv), ""
    except SystemExit as e:  # bench says why in its exit message
        return None, _one_line(str(e.code))


def table(rows: list[dict]) -> str:
    cols = ("check", "status", "measured", "reference", "note")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def _launch_args() -> list[str]:
    """torchrun's rendezvous as run_train.sh gives a job: standalone, or NNODES/NODE_RANK/RDZV_ENDPOINT."""
    nnodes = os.environ.get("NNODES", "1")
    if nnodes == "1" and not os.environ.get("RDZV_ENDPOINT"):
        return ["--standalone"]
    return [f"--nnodes={nnodes}", f"--node_rank={os.environ.get('NODE_RANK', '0')}", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={os.environ['RDZV_ENDPOINT']}", f"--rdzv_id={os.environ.get('RDZV_ID', 'titanlite-health')}"]


def _one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def parse(argv: list[str]) -> tuple[dict, list[str]]:
    opts = {"ngpu": None, "warmup": "3", "steps": "5", "min_share": "0.9", "min_datasheet_share": "0.7",
            "tolerance": "0.25", "out": None, "_role": None, "_result": None}
    rest = split_flags(argv, opts, ("--skip-run",))
    opts.setdefault("skip_run", False)
    try:
        for key in ("ngpu", "warmup", "steps"):
            if opts[key] is not None:
                opts[key] = int(opts[key])
                if opts[key] < 1:
                    raise ValueError
        for key in ("min_share", "min_datasheet_share", "tolerance"):
            opts[key] = float(opts[key])
    except ValueError:
        raise ConfigError(f"--{key.replace('_', '-')}: expected a positive number, got '{opts[key]}'") from None
    return opts, rest


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    try:
        opts, rest = parse(argv)
        _inject()
        if opts["_role"] == "checks":
            result = run_checks()
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                Path(opts["_result"]).write_text(json.dumps(result))
            return
    except ConfigError as e:
        print(f"titanlite: error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(healthcheck(opts, rest))


def healthcheck(opts: dict, rest: list[str]) -> int:
    """The node's parent process: the checks over torchrun, the job run and its dry run; 0 when all pass."""
    tmp = Path(tempfile.mkdtemp(prefix="titanlite-health-"))
    try:
        return check_node(opts, rest, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_node(opts: dict, rest: list[str], tmp: Path) -> int:
    """healthcheck, its ranks' and dry run's results written in `tmp`."""
    start = time.perf_counter()
    cuda = torch.cuda.is_available()
    ngpu = opts["ngpu"] or (torch.cuda.device_count() if cuda else 2)
    run_argv = rest if any(a.startswith("--config") for a in rest) else [*(GPU_RUN if cuda else CPU_RUN), *rest]
    if not cuda:
        print(f"titanlite: no GPU found: checking this CPU instead, over {ngpu} gloo ranks: the fp32 matmul and "
              f"memory-copy rates against fixed floors ({CPU_FLOORS['matmul_tflops']:g} TFLOPS, "
              f"{CPU_FLOORS['membw_gbps']:g} GB/s per rank), gloo collectives, the debug model's losses, compile, "
              "and a short run of the debug model", flush=True)
    gpu = datasheet(torch.cuda.get_device_name(0)) if cuda else None
    power = power_limit_w() if cuda else None
    dry = None if opts["skip_run"] else start_dry_run(gpu, ngpu, run_argv, tmp / "dryrun.json", power)
    result = tmp / "checks.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", *_launch_args(), f"--nproc_per_node={ngpu}",
           "-m", "titanlite.tools.healthcheck", "--_role", "checks", "--_result", str(result)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if not result.exists():  # gloo may abort in teardown after the result is written: the file is the proof
        print(f"titanlite: error: the health check's ranks failed (exit {proc.returncode}): "
              f"{_one_line(proc.stdout + proc.stderr)}", file=sys.stderr)
        print((proc.stdout + proc.stderr)[-3000:], file=sys.stderr)
        return 1
    checks = json.loads(result.read_text())
    run, run_error = (None, "") if opts["skip_run"] else job_run(ngpu, opts["warmup"], opts["steps"], run_argv)
    pred, dry_error = finish_dry_run(dry, tmp / "dryrun.json")
    rows = assess(checks, run, pred, opts, run_error, dry_error)
    f = checks["ranks"][0]
    watts = "n/a" if power is None else f"{power:.0f} W"
    line = (f"{f['host']}: {checks['world_size']} rank(s), {checks['local_world_size']} per node, {f['gpu']}"
            + (f" {f['memory_gib']} GiB, driver {f['driver']}, power limit {watts}, CUDA {f['cuda']}, NCCL {f['nccl']}"
               if cuda else "")
            + f", torch {f['torch']}")
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "facts": line, "power_limit_w": power,
              "rows": rows,
              "checks": checks, "run": run, "prediction": None if pred is None else pred["predicted"],
              "seconds": time.perf_counter() - start}
    if opts["out"]:
        Path(opts["out"]).write_text(json.dumps(report, indent=1))
    failed = [r["check"] for r in rows if r["status"] == "FAIL"]
    print(line)
    print(table(rows))
    print(f"health check: {len(failed)} failed" + (f" ({', '.join(failed)})" if failed else "")
          + f", {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    main()
