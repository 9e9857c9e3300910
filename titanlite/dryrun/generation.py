"""A generation job's memory per rank (`python -m titanlite.dryrun --generate BATCHxCONTEXT`):
`python -m titanlite.generate --tp N` of the config's model over --ngpu ranks, `BATCH` prompts
each reaching `CONTEXT` tokens (prompt and generated), in the config's parameter dtype.

  weights  every parameter and buffer this rank holds once the loader has split the model by the
           training plan's tensor parallelism (titanlite.generate.load.shard, applied on meta
           over a fake process group of N ranks): what it reads from a checkpoint
  cache    titanlite.layers.cache.cache_bytes, the formula the cache's bytes are tested against
  decode   one decode step's largest transient: the logits (whole on every rank, in the dtype
           and again in float32) and the largest layer's attention inputs at the full context
           (softmax's with one key more than the context: a bound):
           MLA's latent expanded to this rank's heads (keys and values, the keys joined with
           the RoPE key, the values padded to the keys' width), or softmax attention's keys and
           values copied out to the query heads (grouped heads on CUDA with a mask; a window's
           ring joined with the new token and a sink's zero key are copies of that size too)

Prefill is not counted: titanlite's prefill computes every prompt position's logits and a mask
of the prompt against itself, which a long prompt makes the peak; split a long prompt's batch.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from titanlite.config.job import JobConfig
from titanlite.dryrun.hardware import GIB, GPU
from titanlite.errors import ConfigError
from titanlite.generate.load import check_tp_degree, shard
from titanlite.layers.cache import cache_bytes
from titanlite.model_spec import get_model_spec, model_args


def parse_shape(text: str) -> tuple[int, int]:
    """`BATCHxCONTEXT` (e.g. 1x32768) as (batch, context)."""
    m = re.fullmatch(r"(\d+)[xX](\d+)", text)
    if not m or not int(m[1]) or not int(m[2]):
        raise ConfigError(f"--generate {text}: expected BATCHxCONTEXT, positive integers (e.g. 1x32768: one prompt "
                          "reaching 32768 tokens)")
    return int(m[1]), int(m[2])


def local_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of this rank's parameters and buffers, the floating ones in `dtype` (the loader's cast)."""
    total = 0
    for t in (*model.parameters(), *model.buffers()):
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
    return total


def weights_per_rank(spec: Any, args: Any, tp: int, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes rank 0 holds after the loader's split over `tp` ranks, the model's parameter count)."""
    with torch.device("meta"):
        model = spec.build(args)
    n_params = sum(p.numel() for p in model.parameters())
    if tp == 1:
        return local_bytes(model, dtype), n_params
    # the fake backend exchanges nothing through its store: any in-process store serves
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=tp)
    try:
        shard(model, spec, init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)))
        return local_bytes(model, dtype), n_params
    finally:
        dist.destroy_process_group()


def decode_bytes(args: Any, batch: int, context: int, itemsize: int, tp: int) -> int:
    """One decode step's largest transient on a rank (the module doc)."""
    logits = batch * args.vocab_size * (itemsize + 4)
    if getattr(args, "kv_lora_rank", 0):
        nope, rope, v = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        width = (nope + v) + 2 * (nope + rope)
        return logits + batch * context * args.n_heads // tp * width * itemsize
    softmax = [layer for layer in range(args.n_layers)
               if not (hasattr(args, "layer_type") and args.layer_type(layer) == "linear_attention")]
    keys = max((min(context, args.window(layer) or context) + 1 for layer in softmax), default=0)
    return logits + 2 * batch * keys * args.n_heads // tp * args.head_dim * itemsize


def generation_memory(cfg: JobConfig, tp: int, shape: str, gpu: GPU) -> dict[str, Any]:
    """The report (the module doc) of the generation job `shape` of `cfg`'s model over `tp` ranks."""
    batch, context = parse_shape(shape)
    spec = get_model_spec(cfg.model.name)
    if spec.from_hf_config is not None:
        raise ConfigError(f"--generate: model.name {spec.name} generates with transformers' own attention, whose "
                          "cache has no formula here; dry-run a native family")
    args = model_args(spec, cfg.model.flavor, cfg.model.vocab_size, cfg.training.seq_len, cfg.moe)
    args = dataclasses.replace(args, max_seq_len=args.context_len or args.max_seq_len)  # as the loader reads it
    if context > args.max_seq_len:
        raise ConfigError(f"--generate {shape}: {cfg.model.name} {cfg.model.variant}'s context is {args.max_seq_len} "
                          f"tokens; ask for {args.max_seq_len} at most")
    try:
        check_tp_degree(args, tp)
    except ConfigError as e:
        raise ConfigError(str(e).replace("--tp", "--ngpu (the generator's --tp)")) from None
    name = cfg.training.mixed_precision_param
    dtype = torch.bfloat16 if name == "auto" else getattr(torch, name)  # auto: bf16 on a GPU
    weights, n_params = weights_per_rank(spec, args, tp, dtype)
    parts = {"weights": weights, "cache": cache_bytes(args, batch, context, dtype.itemsize, tp),
             "decode": decode_bytes(args, batch, context, dtype.itemsize, tp)}
    total = sum(parts.values())
    return {"model": cfg.model.name, "flavor": cfg.model.variant, "tp": tp, "batch": batch, "context": context,
            "dtype": str(dtype).removeprefix("torch."), "parameters": n_params,
            "bytes": {**parts, "total": total}, "gpu": gpu.name, "memory_limit_gib": gpu.memory_gib,
            "fits": total / GIB <= gpu.memory_gib}


def print_generation(rep: dict[str, Any]) -> None:
    print(f"generation: {rep['model']} {rep['flavor']} ({rep['parameters']:,} parameters), tensor parallel "
          f"{rep['tp']}, {rep['batch']} x {rep['context']} tokens, {rep['dtype']}; per rank:")
    what = {"weights": "this rank's share", "cache": "titanlite.layers.cache.cache_bytes",
            "decode": "one step's logits and largest attention transient", "total": "prefill not counted"}
    for k, v in rep["bytes"].items():
        print(f"  {k:<8} {v / GIB:9.2f} GiB  ({what[k]})")
    if rep["fits"]:
        print(f"fits in the {rep['gpu']}'s {rep['memory_limit_gib']:.1f} GiB")
