"""Peers for `titanlite.tools.bench`: the same model shape trained by other code.

`time_peer` times the Hugging Face transformers model of the same family (LlamaForCausalLM,
GptOssForCausalLM, ...) in a plain PyTorch loop
(DistributedDataParallel over gloo/NCCL when there are several ranks) with the same
micro-batch, accumulation, dtype, optimizer and thread count as the titanlite run.
`run_torchtitan` runs torchtitan itself where it is installed on a CUDA machine.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F



def hf_llama(args, dtype: torch.dtype) -> torch.nn.Module:
    """LlamaForCausalLM with the same matmul shapes as titanlite's llama3 ModelArgs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_hidden,
                         num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                         num_key_value_heads=args.n_kv_heads, max_position_embeddings=args.max_seq_len,
                         rms_norm_eps=args.norm_eps, tie_word_embeddings=args.tie_embeddings,
                         attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(hf_cfg).to(dtype)


def hf_peer(spec, args, dtype: torch.dtype) -> torch.nn.Module:
    """The transformers model of the family's own config.json (its Hugging Face adapter): Llama's
    as above, any other family (gpt-oss, Qwen3) as transformers builds it from that config."""
    if spec.name == "llama3":
        return hf_llama(args, dtype)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(spec.hf.config_to_hf(args, dtype))
    hf_cfg = AutoConfig.for_model(config.pop("model_type"), **config, use_cache=False)
    return AutoModelForCausalLM.from_config(hf_cfg).to(dtype)


def time_peer(bench_args, cfg, plan, device: torch.device, dtype: torch.dtype) -> float:
    """Seconds for `bench_args.steps` steps of the transformers peer after its warm-up, on the
    process group titanlite.tools.bench set up; the same batch, optimizer and clipping."""
    t = cfg.training
    torch.manual_seed(t.seed)
    # fp32 master weights with autocast, as titanlite keeps them (FSDP mixed precision or autocast)
    model = hf_peer(plan.spec, plan.args, torch.float32).to(device)
    world = dist.get_world_size()
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    o = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay, foreach=True)
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext())
    accum = plan.global_batch_size // (t.local_batch_size * plan.dims.dp)
    gen = torch.Generator().manual_seed(t.seed + dist.get_rank())
    tokens = torch.randint(0, plan.args.vocab_size, (accum, t.local_batch_size, t.seq_len + 1), generator=gen)
    n_targets = accum * t.local_batch_size * t.seq_len * plan.dims.dp

    def step() -> torch.Tensor:
        loss_sum = torch.zeros((), device=device)
        for i in range(accum):
            inputs = tokens[i, :, :-1].to(device, non_blocking=True)
            labels = tokens[i, :, 1:].to(device, non_blocking=True)
            sync = model.no_sync() if world > 1 and i < accum - 1 else contextlib.nullcontext()
            with sync, autocast:
                logits = model(input_ids=inputs).logits
            with sync:
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
                (loss / n_targets).backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss_sum

    for _ in range(bench_args.warmup):
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(bench_args.steps):
        loss = step()
    loss.item()
    _sync(device)
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_torchtitan(bench_args, cfg, plan) -> dict | None:
    """torchtitan on the same flavor, batch and FSDP layout; its own log gives tokens/s and MFU.
    Returns None (with a note) where it cannot run: no CUDA, or torchtitan not installed."""
    if not torch.cuda.is_available():
        print("torchtitan: skipped (needs a CUDA machine)")
        return None
    if importlib.util.find_spec("torchtitan") is None:
        print("torchtitan: skipped (not installed; `pip install torchtitan` on the GPU machine)")
        return None
    t, dims = cfg.training, plan.dims
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={bench_args.ngpu}",
           "-m", "torchtitan.train", "--model.name", cfg.model.name, "--model.flavor", cfg.model.flavor,
           "--training.local_batch_size", str(t.local_batch_size), "--training.seq_len", str(t.seq_len),
           "--training.steps", str(bench_args.warmup + bench_args.steps), "--metrics.log_freq", "1",
           "--parallelism.data_parallel_shard_degree", str(dims.dp_shard),
           "--parallelism.data_parallel_replicate_degree", str(dims.dp_replicate),
           "--parallelism.tensor_parallel_degree", str(dims.tp),
           "--parallelism.context_parallel_degree", str(dims.cp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    # torchtitan logs "step: N ... tps: X ... mfu: Y%" per step
    steps = [(int(m[0]), float(m[1].replace(",", "")), float(m[2]))
             for m in re.findall(r"step:\s*(\d+).*?tps:\s*([\d,.]+).*?mfu:\s*([\d.]+)%", out)]
    timed = [s for s in steps if s[0] > bench_args.warmup]
    if not timed:
        print(f"torchtitan: failed (exit {proc.returncode}); last output:\n{out[-2000:]}")
        return None
    tps = sum(s[1] for s in timed) / len(timed)
    tokens = t.local_batch_size * t.seq_len
    return {"name": "torchtitan", "tokens_per_sec_per_device": tps, "ms_per_step": 1000 * tokens / tps,
            "mfu_pct": sum(s[2] for s in timed) / len(timed), "peak_memory_gib": None,
            "torchtitan_log_tail": json.dumps(out[-500:])}
