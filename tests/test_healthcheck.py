"""The health check (titanlite.tools.healthcheck): its judgement on figures from test doubles, and
one real CPU run over two gloo ranks with a slow device and a wrong loss injected."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from titanlite.tools.healthcheck import assess, datasheet

REPO = Path(__file__).resolve().parent.parent
OPTS = {"min_share": 0.9, "min_datasheet_share": 0.7, "tolerance": 0.25, "skip_run": True}
LOSSES = [6.3, 6.1, 5.9, 5.7, 5.5]


def _rank(rank: int, matmul: float, gpu: str = "NVIDIA H100 80GB HBM3", membw: float = 3000.0) -> dict:
    return {"rank": rank, "node": 0, "host": "n0", "gpu": gpu, "matmul_tflops": matmul, "membw_gbps": membw,
            "numerics": {"host_fp32": LOSSES, "device_fp32": LOSSES, "device_bf16": LOSSES},
            "collectives": {"all_reduce node": 300.0}}


def _status(rows: list[dict], check: str) -> str:
    return next(r["status"] for r in rows if r["check"].startswith(check))


def test_slow_device_is_named_against_median_and_datasheet():
    # a test double for the matmul rate: rank 2 measures 60% of its peers, which themselves sit at
    # 85% of the H100's best measured rate (794.5 TFLOPS)
    checks = {"ranks": [_rank(0, 675.0), _rank(1, 672.0), _rank(2, 400.0), _rank(3, 670.0)]}
    rows = assess(checks, None, None, OPTS)
    assert [r["status"] for r in rows if r["check"].startswith("matmul")] == ["PASS", "PASS", "FAIL", "PASS"]
    slow = next(r for r in rows if r["check"].startswith("matmul rank 2"))
    # each bar that failed, with the share measured and the bar
    assert slow["note"] == ("59.6% of the node median, below --min-share 90%; 50.3% of the datasheet, below "
                            "--min-datasheet-share 70%"), slow["note"]
    edge = assess({"ranks": [_rank(0, 700.0), _rank(1, 700.0), _rank(2, 562.8)]}, None, None, OPTS)
    assert [r["note"] for r in edge if r["check"].startswith("matmul rank 2")] == [
        "80.4% of the node median, below --min-share 90%"]
    assert _status(rows, "all_reduce node") == "PASS"  # 300 GB/s of NVLink's 450 x 0.8
    # the same node on a part the dry run has no figures for: the median alone judges
    pcie = {"ranks": [_rank(r, m, gpu="NVIDIA H100 PCIe") for r, m in enumerate((300.0, 302.0, 150.0))]}
    rows = assess(pcie, None, None, OPTS)
    assert [r["status"] for r in rows if r["check"].startswith("matmul")] == ["PASS", "PASS", "FAIL"]
    assert _status(rows, "all_reduce node") == "INFO" and datasheet("NVIDIA H100 PCIe") is None


def test_on_a_cpu_fixed_floors_judge_each_rank_not_the_median():
    """Two ranks sharing busy cores measure what the load leaves them: 40% of the median is load,
    not a fault; a rate below the floor is."""
    from titanlite.tools.healthcheck import CPU_FLOORS

    cpu = "none (CPU, gloo)"
    busy = {"ranks": [_rank(0, 0.07, gpu=cpu, membw=40.0), _rank(1, 0.028, gpu=cpu, membw=12.0)]}
    assert {r["status"] for r in assess(busy, None, None, OPTS) if r["check"].startswith(("matmul", "membw"))} == \
        {"PASS"}
    broken = {"ranks": [_rank(0, 0.07, gpu=cpu, membw=40.0), _rank(1, 0.001, gpu=cpu, membw=1.5)]}
    rows = {r["check"]: r for r in assess(broken, None, None, OPTS)}
    assert rows["matmul rank 1 (n0)"]["note"] == f"below the CPU floor of {CPU_FLOORS['matmul_tflops']:g} TFLOPS"
    assert rows["membw rank 1 (n0)"]["note"] == f"below the CPU floor of {CPU_FLOORS['membw_gbps']:g} GB/s"
    assert [c for c, r in rows.items() if r["status"] == "FAIL"] == ["matmul rank 1 (n0)", "membw rank 1 (n0)"]


def test_numerics_and_prediction_judged():
    bad = _rank(0, 700.0)
    bad["numerics"] = {"host_fp32": LOSSES, "device_fp32": [x + 2e-4 for x in LOSSES],
                       "device_bf16": [x * 1.03 for x in LOSSES]}
    run = {"model": "llama3 1B", "layout": "dp_shard 1", "local_batch_size": 2, "seq_len": 8192,
           "tokens_per_sec_per_device": 14000.0, "mfu_pct": 30.0, "peak_memory_gib": 30.0}
    pred = {"predicted": {"tokens_per_sec_per_gpu": 20000.0, "mfu_pct": 40.0, "gpu": "h100", "power_w": 500.0},
            "roles": [{"memory_gib": {"peak": 28.0}}]}
    rows = assess({"ranks": [bad]}, run, pred, {**OPTS, "skip_run": False})
    assert _status(rows, "numerics fp32") == "FAIL" and _status(rows, "numerics bf16") == "FAIL"
    notes = [r["note"] for r in rows if r["check"].startswith("numerics")]
    assert notes == ["first 5 losses: 2.0e-04 is over the bound 1e-04", "3.0% of the fp32 loss, over the bound 2%"]
    assert _status(rows, "job tokens/s") == "FAIL"  # 30% below the prediction, past the 25% tolerance
    # the prediction is for this GPU at the power limit its driver enforces
    assert next(r["reference"] for r in rows if r["check"].startswith("job tokens/s")) == \
        "dry run 20,000 on h100 at 500 W (-30.0%)"
    assert next(r["reference"] for r in rows if r["check"] == "job peak memory") == "dry run 28.00 GiB (+7.1%)"


def test_power_limit_is_the_driver_s(tmp_path, monkeypatch):
    """The enforced power limit as nvidia-smi reports it, passed to the dry run; none without a
    driver (a CPU machine: the run's rows say n/a)."""
    from titanlite.tools.healthcheck import power_limit_w, run_rows

    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "$@" > ' + str(tmp_path / "args") + "\necho 500.00\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert power_limit_w() == 500.0 and "power.limit" in (tmp_path / "args").read_text()
    smi.unlink()
    assert power_limit_w() is None
    run = {"model": "llama3 debugmodel", "layout": "dp_shard 2", "local_batch_size": 2, "seq_len": 64,
           "tokens_per_sec_per_device": 900.0, "mfu_pct": None, "peak_memory_gib": 0.1}
    rows = run_rows(run, None, {**OPTS, "skip_run": False})
    assert all(r["note"].endswith("(power limit: n/a)") for r in rows)


def test_cpu_healthcheck_runs_and_fails_on_injected_faults(tmp_path):
    """The whole check on two gloo ranks, as a user runs it: its first line says no GPU was found
    and what it checks instead; rank 1's matmul rate cut to a hundredth (below the CPU floor)
    and rank 0's device losses shifted by 1e-3 must be named, nothing else fails (the rates of
    ranks on a busy CPU are judged against floors, not each other), and the run exits 1."""
    out = tmp_path / "report.json"
    env = {**os.environ, "TITANLITE_HEALTH_INJECT": "slow_matmul:1,bad_numerics:0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "titanlite.tools.healthcheck", "--steps", "2", "--warmup", "1",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    rows = {r["check"]: r for r in report["rows"]}
    assert rows["matmul rank 1 (%s)" % report["checks"]["ranks"][1]["host"]]["status"] == "FAIL"
    assert rows["numerics fp32 rank 0"]["status"] == "FAIL" and rows["numerics fp32 rank 1"]["status"] == "PASS"
    assert rows["numerics bf16 rank 1"]["status"] == "PASS"
    assert rows["feature compile (node 0)"]["status"] == "PASS"
    assert {rows[f"feature {f} (node 0)"]["status"] for f in ("float8", "flex", "varlen")} == {"SKIP"}
    assert report["run"]["tokens_per_sec_per_device"] > 0 and report["checks"]["world_size"] == 2
    assert {r["status"] for r in report["rows"]} <= {"PASS", "FAIL", "SKIP", "INFO"}
    failed = [r["check"] for r in report["rows"] if r["status"] == "FAIL"]
    assert failed == ["matmul rank 1 (%s)" % report["checks"]["ranks"][1]["host"], "numerics fp32 rank 0"], failed
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("titanlite: no GPU found: checking this CPU instead, over 2 gloo ranks: "), lines[0]
    assert lines[-1].startswith("health check: 2 failed"), lines[-1]


def test_run_train_sh_runs_the_healthcheck():
    """./run_train.sh --healthcheck hands its flags to the health check (stopped here by a bad
    one: exit 2 and one line)."""
    proc = subprocess.run([str(REPO / "run_train.sh"), "--healthcheck", "--steps", "0"], cwd=REPO,
                          env={**os.environ, "NGPU": "2"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == \
        "titanlite: error: --steps: expected a positive number, got '0'", proc.stderr
