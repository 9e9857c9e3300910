"""Muon against AdamW at equal steps: `python -m titanlite.tools.bench_muon --config X [--steps N]
[--adamw-steps M] [--ngpu G] [--section.key value ...]`.

Trains the config with each optimizer's defaults for N steps, evaluating the held-out loss every
N/10 steps on the same batches, and prints both curves. With M > N it also trains AdamW for M steps
(default 3N; 0 skips it) and reports the first evaluation at which that run's held-out loss is at
or below Muon's final one: its LR decays over M steps, the run a user would make to get there.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from titanlite.config import load as config_load
from titanlite.model_spec import get_model_spec, model_args
from titanlite.optim import build_optimizers


def _run(args: list[str], ngpu: int, dump: Path) -> list[tuple[int, float]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ngpu), "-m", "titanlite.train",
           *args, "--job.dump_folder", str(dump), "--metrics.enable_tensorboard", "false"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]


def _flag(argv: list[str], name: str, default: int) -> tuple[int, list[str]]:
    if name not in argv:
        return default, argv
    i = argv.index(name)
    return int(argv[i + 1]), argv[:i] + argv[i + 2:]


def optimizer_step_ms(argv: list[str], name: str, repeats: int = 20) -> float:
    cfg, _ = config_load.load(argv)
    spec = get_model_spec(cfg.model.name)
    model = spec.build(model_args(spec, cfg.model.flavor, cfg.model.vocab_size, cfg.training.seq_len))
    model.init_weights(cfg.training.seed)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opts = build_optimizers([model], dataclasses.replace(cfg.optimizer, name=name), cfg.lr_scheduler, cfg.training.steps)
    times = []
    for _ in range(3 + repeats):
        start = time.perf_counter()
        opts.step()
        times.append(time.perf_counter() - start)
    return 1000 * min(times[3:])


def main(argv: list[str]) -> None:
    if "--optimizer-step" in argv:
        argv = [a for a in argv if a != "--optimizer-step"]
        ms = {name: optimizer_step_ms(argv, name) for name in ("AdamW", "Muon")}
        print(json.dumps({"optimizer_step_ms": ms, "threads": torch.get_num_threads()}))
        return
    steps, argv = _flag(argv, "--steps", 100)
    adamw_steps, argv = _flag(argv, "--adamw-steps", 3 * steps)
    ngpu, argv = _flag(argv, "--ngpu", 1)
    every = max(1, steps // 10)
    common = [*argv, "--validation.freq", str(every), "--validation.steps", "4"]
    with tempfile.TemporaryDirectory(prefix="bench-muon-") as tmp:
        muon = _run([*common, "--training.steps", str(steps), "--optimizer.name", "Muon"], ngpu, Path(tmp, "muon"))
        adamw = _run([*common, "--training.steps", str(steps), "--optimizer.name", "AdamW"], ngpu, Path(tmp, "adamw"))
        longer = (_run([*common, "--training.steps", str(adamw_steps), "--optimizer.name", "AdamW"], ngpu,
                       Path(tmp, "adamw-long")) if adamw_steps > steps else [])
    print(f"{'step':>6} {'Muon val':>9} {'AdamW val':>9}")
    for (step, m), (_, a) in zip(muon, adamw):
        print(f"{step:>6} {m:>9.4f} {a:>9.4f}")
    target = muon[-1][1]
    reach = next((s for s, loss in longer if loss <= target), None)
    print(json.dumps({"steps": steps, "muon_curve": muon, "adamw_curve": adamw, "adamw_long_steps": adamw_steps,
                      "adamw_long_curve": longer, "adamw_steps_to_muon_final": reach}))


if __name__ == "__main__":
    main(sys.argv[1:])
