"""Memory estimate per rank before launch: `python -m titanlite.tools.estimate --config X --ngpu N [overrides]`.

Nothing real is allocated: parameter shapes come from the model built on the meta device,
their per-rank share from the mesh arithmetic (FSDP shards dim 0 over dp_shard x cp, TP
splits the block and embedding matrices), and activations from what eager autograd keeps
for each Llama block under the chosen activation-checkpointing mode.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

from titanlite import config_load
from titanlite.config import JobConfig
from titanlite.errors import ConfigError
from titanlite.parallel.mesh import ParallelDims

GIB = 2**30


@dataclass(frozen=True)
class Estimate:
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    """Saved for backward at the end of forward (blocks, final norm, logits and loss)."""
    backward_buffers: float
    """Short-lived at the start of backward: logit gradients, one recomputed block, FSDP's
    unsharded parameters and buffers in flight."""
    reduce_buffers: float
    """FSDP's last gradient reduce-scatter at the end of backward: the root's unsharded
    gradients and their reduce-scatter input, live beside every other gradient."""
    step_buffers: float
    """AdamW's temporaries during the optimizer step (foreach only; fused makes none)."""

    @property
    def total(self) -> float:
        """The peak: gradients appear as backward frees the activations, so the start of
        backward, its end and the optimizer step are the candidates."""
        return self.parameters + self.optimizer + max(self.activations + self.backward_buffers,
                                                      self.gradients + self.reduce_buffers,
                                                      self.gradients + self.step_buffers)


def _local_numel(param: nn.Parameter, dims: ParallelDims) -> int:
    shape = list(param.shape)
    if dims.tp > 1 and len(shape) == 2:
        shape[0] = math.ceil(shape[0] / dims.tp)  # colwise/rowwise alike: 1/tp of the matrix
    shard = dims.dp_shard * dims.cp
    if shard > 1:
        shape[0] = math.ceil(shape[0] / shard)  # FSDP pads dim 0 to a multiple of the degree
    return math.prod(shape)


def block_activation_elems(args, mode: str, selective_every: int, selective_type: str) -> float:
    """Elements per token that autograd keeps for all blocks after forward.

    Eager Llama block, per token (D = dim, K = kv dim, F = ffn hidden): the block input,
    norm outputs and the residual (3D), q and k before and after RoPE (2D + K), k after RoPE
    and v as attention reads them (2K: shared heads are not expanded), the attention output
    and its contiguous copy (2D), the FFN's w1 and w3 outputs, SiLU output and their product
    (4F), plus the RMS norm output of the second norm (D): 8D + 3K + 4F. Full AC keeps only
    the block input (D); per-op AC keeps the matmul and attention outputs (q, k, v,
    attention, wo, w1, w3, w2) and the block input: 5D + 2K + 2F.
    """
    d, k, f, n = args.dim, args.n_kv_heads * args.head_dim, args.ffn_hidden, args.n_layers
    none, full, per_op = 8 * d + 3 * k + 4 * f, d, 5 * d + 2 * k + 2 * f
    if mode == "none":
        return n * none
    if mode == "full":
        return n * full
    if selective_type == "op":
        return n * per_op
    recomputed = math.ceil(n / selective_every)
    return recomputed * full + (n - recomputed) * none


def estimate(cfg: JobConfig, world_size: int) -> tuple[Estimate, ParallelDims]:
    """The peak of the busiest rank: with pipeline stages, each pipeline rank is estimated for
    the blocks it holds and the micro-batches its schedule keeps in flight, and the largest wins."""
    from titanlite.preflight import preflight

    plan = preflight(cfg, world_size)
    if plan.stages is None:
        with torch.device("meta"):
            return _estimate(cfg, plan, [plan.spec.build(plan.args)], cfg.training.local_batch_size), plan.dims
    from titanlite.parallel.pipeline import cut

    st, pp = plan.stages, plan.dims.pp
    # GPipe-like schedules run every forward before any backward; the others keep at most
    # about one micro-batch per pipeline rank in flight (the first rank the most)
    flight = st.n_microbatches if cfg.parallelism.pipeline_parallel_schedule in ("GPipe", "LoopedBFS") \
        else min(st.n_microbatches, pp)
    rows = cfg.parallelism.pipeline_parallel_microbatch_size * flight
    estimates = []
    for r in range(pp):
        with torch.device("meta"):
            parts = [cut(plan.spec.build(plan.args), plan.spec, *st.blocks[s], s == 0, s == st.n_stages - 1)
                     for s in st.stages_of(r, pp)]
        estimates.append(_estimate(cfg, plan, parts, rows))
    return max(estimates, key=lambda e: e.total), plan.dims


def _estimate(cfg: JobConfig, plan, parts: list, rows: int) -> Estimate:
    """One rank holding `parts` (the whole model, or its pipeline stages), with `rows` samples'
    activations alive at once."""
    dims, args, t, ac = plan.dims, plan.args, cfg.training, cfg.activation_checkpoint
    params = [(n, p) for part in parts for n, p in part.named_parameters()]
    local = sum(_local_numel(p, dims) for _, p in params)
    with torch.device("meta"):
        full_block = sum(p.numel() for p in getattr(plan.spec.build(args), plan.spec.blocks)["0"].parameters())
    spec = plan.spec
    root = sum(p.numel() for n, p in params if not n.startswith(spec.blocks + "."))
    held = sum(len(getattr(part, spec.blocks)) for part in parts) / args.n_layers  # share of the blocks here
    has_output = any(not isinstance(getattr(part, spec.post[-1]), torch.nn.Identity) for part in parts)

    device = "cuda" if (t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())) else "cpu"
    low = t.mixed_precision_param == "bfloat16" or (t.mixed_precision_param == "auto" and device == "cuda")
    act_b = 2 if low else 4
    tokens = rows * t.seq_len / dims.cp
    v, d = args.vocab_size / dims.tp, args.dim
    blocks = held * block_activation_elems(args, ac.mode, ac.selective_every, ac.selective_type) / dims.tp
    # outside the blocks: final norm in/out (2D); logits, their fp32 copy under bf16, and log-softmax
    logits = v * (act_b + (4 if low else 0) + 4) if has_output else 0.0
    activations = tokens * ((blocks + 2 * d) * act_b + logits)

    # backward starts with the logit gradient and, if the last block is checkpointed, its
    # recomputation (later recomputations happen after other blocks' activations are freed)
    n = args.n_layers
    none = block_activation_elems(args, "none", 1, "layer") / n
    recompute = {"none": 0.0, "full": none - d}.get(ac.mode, 0.0)
    if ac.mode == "selective" and ac.selective_type == "layer":
        recompute = none - d if (n - 1) % ac.selective_every == 0 else 0.0
    elif ac.mode == "selective":
        recompute = none - block_activation_elems(args, "selective", 1, "op") / n
    backward = tokens * ((4 * v if has_output else 0.0) + recompute * act_b / dims.tp)
    if dims.fsdp:
        # the unsharded root and, while the prefetched block is copied out of its all-gather
        # buffer, three blocks' worth of unsharded parameters in the compute dtype; a block's
        # gradient reduce-scatter buffers come later, once its activations are freed
        # (pipeline stages keep all their blocks gathered from forward to backward)
        gathered = held * args.n_layers if plan.stages is not None else 3
        backward += act_b * (root + gathered * full_block) / dims.tp
    reduce = 4 * 2 * root / dims.tp if dims.fsdp else 0.0
    # foreach AdamW keeps one parameter-sized temporary (sqrt of the second moment)
    step = 4 * local if cfg.optimizer.implementation == "foreach" else 0.0
    e = Estimate(parameters=4 * local, gradients=4 * local, optimizer=8 * local, activations=activations,
                 backward_buffers=backward, reduce_buffers=reduce, step_buffers=step)
    return e


def _parse(argv: list[str]) -> tuple[int, list[str]]:
    ngpu, rest, i = 1, [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name == "--ngpu":
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError("--ngpu needs a value")
                i, value = i + 1, argv[i + 1]
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--ngpu: expected a positive integer, got '{value}'")
            ngpu = int(value)
        else:
            rest.append(argv[i])
        i += 1
    return ngpu, rest


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    try:
        ngpu, rest = _parse(argv)
        cfg, _ = config_load.load(rest)
        e, dims = estimate(cfg, ngpu)
    except ConfigError as err:
        sys.exit(f"titanlite: error: {err}")
    ac = cfg.activation_checkpoint
    mode = ac.mode + (f" ({ac.selective_type})" if ac.mode == "selective" else "")
    print(f"{cfg.model.name} {cfg.model.flavor} on {ngpu} rank(s), {dims}, "
          f"batch {cfg.training.local_batch_size}x{cfg.training.seq_len}/rank, AC {mode}")
    for what, value in [("parameters", e.parameters), ("gradients", e.gradients), ("optimizer state", e.optimizer),
                        ("activations", e.activations), ("backward buffers", e.backward_buffers),
                        ("reduce buffers", e.reduce_buffers), ("step buffers", e.step_buffers),
                        ("peak per rank", e.total)]:
        print(f"  {what:<18} {value / GIB:9.3f} GiB")


if __name__ == "__main__":
    main()
