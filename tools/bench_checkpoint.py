"""Checkpoint throughput on one CPU process: sync save, load, and the blocking part of an async save.

    OMP_NUM_THREADS=1 python -m titanlite.tools.bench_checkpoint [--dim 768 --layers 12 --vocab 32000] [--folder DIR]

Uses the trainer's CheckpointManager on a ~100M-parameter Llama (fp32 weights + AdamW
state = ~12 bytes per parameter on disk). GB/s is checkpoint bytes / wall seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.models.llama3 import SPEC
from titanlite.models.llama3.model import ModelArgs
from titanlite.checkpoint.dcp import CheckpointManager
from titanlite.optim import Optimizers
from titanlite.config.data import Data
from titanlite.config.job import Checkpoint
from titanlite.data.loader import build_dataloader
from titanlite.parallel.mesh import init_process_group
from titanlite.data.tokenizer import build_tokenizer


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--folder", default="")
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    os.environ.setdefault("MASTER_PORT", "29533")
    init_process_group(torch.device("cpu"), 600)
    args = ModelArgs(dim=a.dim, n_layers=a.layers, n_heads=12, n_kv_heads=4, vocab_size=a.vocab, max_seq_len=64)
    model = SPEC.build(args)
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    opt.step()  # materialize AdamW state, as in a real run
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    loader = build_dataloader(Data(), build_tokenizer("byte"), seq_len=64, global_batch_size=8,
                              local_batch_size=8, dp_rank=0, dp_degree=1)
    n_params = sum(q.numel() for q in model.parameters())
    dump = Path(a.folder or tempfile.mkdtemp(prefix="bench-ckpt-"))
    print(f"model: {n_params / 1e6:.1f}M params, dump {dump}, torch {torch.__version__}")

    def manager(mode: str) -> CheckpointManager:
        cfg = Checkpoint(enable=True, interval=1, async_mode=mode, folder=f"ckpt-{mode}")
        return CheckpointManager(cfg, str(dump), parts=[model], optimizers=Optimizers([model], [opt], [sched]), loader=loader,
                                 data=Data(), seq_len=64, global_batch_size=8, spec=SPEC, args=args,
                                 final_step=10**9)

    for rep in range(a.repeats):
        sync = manager("disabled")
        t0 = time.perf_counter()
        sync.maybe_save(rep + 1)
        save_s = time.perf_counter() - t0
        size = folder_bytes(dump / "ckpt-disabled" / f"step-{rep + 1}")
        t0 = time.perf_counter()
        sync.maybe_load()
        load_s = time.perf_counter() - t0

        asyn = manager("async")
        t0 = time.perf_counter()
        asyn.maybe_save(rep + 1)
        asyn.wait_for_staging()
        blocked_s = time.perf_counter() - t0
        asyn.close()
        total_s = time.perf_counter() - t0
        gb = size / 1e9
        print(f"[{rep}] size {gb:.2f} GB | sync save {save_s:.2f}s ({gb / save_s:.2f} GB/s) | "
              f"load {load_s:.2f}s ({gb / load_s:.2f} GB/s) | async save blocks {blocked_s:.2f}s, "
              f"done after {total_s:.2f}s", flush=True)
        shutil.rmtree(dump / "ckpt-disabled")
        shutil.rmtree(dump / "ckpt-async")
    dist.destroy_process_group()
    if not a.folder:
        shutil.rmtree(dump, ignore_errors=True)


if __name__ == "__main__":
    main()
