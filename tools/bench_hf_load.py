"""What loading Hugging Face weights (checkpoint.initial_load_format hf) adds to a rank's peak memory.

    OMP_NUM_THREADS=1 python -m titanlite.tools.bench_hf_load [--ranks 8]

Writes two transformers folders from freshly initialized models (qwen3_moe bench100m, a MoE
of 107.5M parameters, and its dense twin bench100m_dense, fp32), then starts the real
trainer on --ranks gloo ranks for one step: the MoE folder under FSDP over every rank, the
MoE folder also under TP 2 x EP 2 x FSDP, the dense one under TP 2 x FSDP. Each rank records its peak RSS just before and just after the
initial load; the difference is what the load added to the rank's peak. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS = {"moe": ("qwen3_moe", "bench100m"), "dense": ("qwen3_moe", "bench100m_dense")}
# (folder, layout); TP needs an expert-parallel degree to match it, even in the dense twin (MoE args)
TP = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"]
RUNS = [("moe", []), ("moe", TP), ("dense", TP)]


def worker(argv: list[str]) -> None:
    """One torchrun rank: train, recording the peak RSS around the initial load."""
    from titanlite.checkpoint.dcp import CheckpointManager
    from titanlite.train import main

    load, dump = CheckpointManager._initial_load, Path(argv[argv.index("--job.dump_folder") + 1])

    def measured(self, path, fmt):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        load(self, path, fmt)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        (dump / f"rss-rank{os.environ['RANK']}.json").write_text(json.dumps([before / 2**20, after / 2**20]))

    CheckpointManager._initial_load = measured
    main(argv)


def write_folder(kind: str, folder: Path) -> int:
    """A transformers folder of a freshly initialized model; returns its parameter count."""
    import torch

    from titanlite.checkpoint.hf import write_hf_folder
    from titanlite.config import load as config_load
    from titanlite.preflight import make_plan

    name, flavor = MODELS[kind]
    cfg, _ = config_load.load(["--model.name", name, "--model.flavor", flavor])
    plan = make_plan(cfg, 1)
    model = plan.spec.build(plan.args)
    model.init_weights(0)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    write_hf_folder(folder, plan.spec.hf.to_hf(sd, plan.args), plan.spec.hf.config_to_hf(plan.args, torch.float32))
    return sum(v.numel() for k, v in sd.items() if not k.endswith("expert_bias"))


def run(kind: str, layout: list[str], ranks: int, folder: Path) -> list[tuple[float, float]]:
    dump = Path(tempfile.mkdtemp(prefix=f"bench-hf-{kind}-"))
    name, flavor = MODELS[kind]
    args = ["--model.name", name, "--model.flavor", flavor, *layout,
            "--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_format", "hf",
            "--training.seq_len", "64", "--training.local_batch_size", "1", "--training.steps", "1",
            "--lr_scheduler.warmup_steps", "1", "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(dump)]
    env = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072", **os.environ, "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           "-m", __spec__.name, "--worker", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    files = [dump / f"rss-rank{r}.json" for r in range(ranks)]
    if not all(f.exists() for f in files):
        sys.exit(f"{kind} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return [tuple(json.loads(f.read_text())) for f in files]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="titanlite-bench-hf-"))
    print("| folder | layout | parameters (fp32 size) | added to a rank's peak by the load, GiB (min / max over ranks) "
          "| peak after the load, GiB (max) |\n|---|---|---:|---:|---:|")
    params = {kind: write_folder(kind, tmp / kind) for kind in MODELS}
    for kind, tp in RUNS:
        n, rss = params[kind], run(kind, tp, a.ranks, tmp / kind)
        added = [after - before for before, after in rss]
        layout = (f"TP 2 x EP 2 x FSDP {a.ranks // 2}" if kind == "moe" else f"TP 2 x FSDP {a.ranks // 2}") \
            if tp else f"FSDP {a.ranks}"
        print(f"| {' '.join(MODELS[kind])} | {layout} "
              f"| {n / 1e6:.1f}M ({n * 4 / 2**30:.2f} GiB) | {min(added):.2f} / {max(added):.2f} "
              f"| {max(after for _, after in rss):.2f} |", flush=True)


if __name__ == "__main__":
    main()
