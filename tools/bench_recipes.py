"""The figures of docs/recipes.md: the debug model on the embedded data, one process, each recipe
against the same run without it, by held-out loss (256 samples of 128 tokens of the held-out tail).

    python -m titanlite.tools.bench_recipes [--steps 200] [--out FILE] [--device cpu] [--only NAME,...]

baseline        global batch 8 x 128 tokens, `steps` steps, warm-up 10 then linear decay (the default)
batch_warmup    the same tokens with batch-size warm-up 2 -> 4 -> 8 (a fifth of the steps each
                below 8) and the sqrt learning-rate rescale: more, smaller steps first
seq_warmup      the same tokens with sequence-length warm-up 32 -> 64 -> 128 (a quarter of the
                steps each), tokens per step constant
z_loss          training.z_loss 1e-4 (its mean logsumexp^2 against the baseline's)
constant_lr     no decay (decay_ratio 0), and checkpoint.merge_last 50: the final weights and the
                average of the last 50 steps' (step-N/merged), each evaluated on the same
                held-out samples (the merged by a run that loads it and takes one step at lr 1e-20,
                no change in fp32)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

VAL_STEPS = 32  # x global batch 8: 256 of the 1,244 held-out samples of seq_len 128


def _run(dump: Path, args: list[str], device: str) -> list[dict]:
    cmd = [sys.executable, "-m", "titanlite.train", "--config", "debug_model.toml", "--job.dump_folder", str(dump),
           "--training.device", device, "--training.seq_len", "128", "--training.local_batch_size", "8",
           "--training.global_batch_size", "8", "--metrics.log_freq", "10",
           "--comm.init_timeout_s", "3600", "--comm.train_timeout_s", "3600",  # a busy machine's steps
           "--metrics.enable_tensorboard", "false", "--validation.steps", str(VAL_STEPS), *args]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def _val(rows: list[dict]) -> float:
    return [r["val_loss"] for r in rows if "val_loss" in r][-1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m titanlite.tools.bench_recipes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="")
    parser.add_argument("--only", default="")
    a = parser.parse_args(argv)
    n, root = a.steps, Path(tempfile.mkdtemp(prefix="titanlite-recipes-"))
    val = ["--validation.freq", str(n), "--training.steps", str(n)]
    # batch warm-up: 2 for n/5 steps, 4 for n/5 steps, then 8 until the baseline's n x 8 samples
    q = n // 5
    warm_steps = 2 * q + (8 * n - 2 * q - 4 * q) // 8
    runs = {
        "baseline": [*val],
        "batch_warmup": ["--validation.freq", str(warm_steps), "--training.steps", str(warm_steps),
                         "--training.batch_warmup", f"2:{q},4:{2 * q}", "--training.batch_warmup_sqrt_lr", "true"],
        "seq_warmup": [*val, "--training.seq_warmup", f"32:{n // 4},64:{n // 2}"],
        "z_loss": [*val, "--training.z_loss", "1e-4"],
        "constant_lr": [*val, "--lr_scheduler.decay_ratio", "0", "--checkpoint.enable", "--checkpoint.interval",
                        str(n), "--checkpoint.merge_last", "50"],
    }
    only = set(a.only.split(",")) if a.only else set(runs)
    results = {}
    for name, args in runs.items():
        if name not in only:
            continue
        rows = _run(root / name, args, a.device)
        train = [r for r in rows if "loss" in r]
        results[name] = {"val_loss": _val(rows), "steps": train[-1]["step"], "train_loss": train[-1]["loss"],
                         **({"z_loss": train[-1]["z_loss"]} if "z_loss" in train[-1] else {})}
        if name == "constant_lr":
            merged = root / name / "checkpoint" / f"step-{n}" / "merged"
            again = _run(root / "merged_eval", ["--training.steps", "1", "--validation.freq", "1", "--optimizer.lr",
                                                "1e-20", "--checkpoint.initial_load_path", str(merged)], a.device)
            results["merged_last_50"] = {"val_loss": _val(again), "steps": n}
        print(json.dumps({name: results[name]}), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
