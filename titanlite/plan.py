"""Which layout to run a model on N GPUs: enumerate, bound, trace the few that can win.

    python -m titanlite.plan --config X --ngpu N [--gpu h100] [--gpus-per-node 8] [--top K] [--out F]
                             [--max-traces T] [--section.key value ...]

Every layout of the job at the config's global batch (dp replicate x shard, tp within a node, cp,
pp with each schedule and micro-batch size, ep for MoE families, activation checkpointing, the
local batch that keeps the global one) is first bounded by formulas that cost nothing: a lower
bound of its per-rank memory and an upper bound of its tokens/s (its FLOPs at the GPU's best
matmul rate, the schedule's bubble, tensor parallel's collectives at link speed). Those that
cannot fit are dropped; the rest are dry-run (titanlite.dryrun) best bound first, until the next
bound, scaled by the best ratio of prediction to bound seen so far, cannot reach the K-th best
layout that fits with a margin, or T layouts have been traced (default 8). The search is bounded by
work, not time, so the same command gives the same layouts on any machine, however busy. With a
batch-size or sequence-length warm-up the global batch is the final one (the largest memory), and
the best layout's earlier phases are traced for their step times (titanlite.dryrun.phases).
docs/scaling.md, "The planner".
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from functools import partial

from titanlite.config import load as config_load
from titanlite.config.job import JobConfig
from titanlite.preflight import Plan, make_plan
from titanlite.dryrun import hardware, timing
from titanlite.dryrun.phases import phase_times
from titanlite.dryrun.report import report
from titanlite.dryrun.run import dry_config, dry_run, split_flags
from titanlite.errors import ConfigError

MARGIN = 0.85
"""A layout fits when its traced tensor peak is at most this share of the GPU's memory: the CUDA
context, NCCL's buffers and the allocator's slack come on top (docs/scaling.md)."""
SCHEDULES = ("1F1B", "Interleaved1F1B")
AC_MODES = ("none", "selective_op", "selective_layer", "full")
# Lower bounds of the bytes a block keeps per token for backward, in units of (dim, ffn hidden)
# bf16 values, before tensor parallel's split: full AC keeps the block input; no AC at least the
# inputs of its matmuls, attention and norms (Llama 3 8B: 69% of the traced); selective op AC
# the matmuls' and attention's outputs; selective layer AC half the blocks each way
_SAVED = {"full": (1, 0), "selective_layer": (4.5, 2), "selective_op": (4, 2), "none": (8, 4)}
# Hardware FLOPs per model FLOP: full AC recomputes the forward (a third of the step), selective
# layer AC every second block's; selective op AC recomputes no matmul counted as a bound
_RECOMPUTE = {"full": 4 / 3, "selective_layer": 7 / 6, "selective_op": 1.0, "none": 1.0}


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int
    pp: int
    ep: int
    schedule: str
    microbatch: int
    """Samples per pipeline micro-batch (the local batch without pipelining)."""
    local_batch: int
    ac: str

    def overrides(self) -> list[str]:
        p = "--parallelism."
        out = [f"{p}data_parallel_replicate_degree", str(self.dp_replicate), f"{p}data_parallel_shard_degree",
               str(self.dp_shard), f"{p}tensor_parallel_degree", str(self.tp), f"{p}context_parallel_degree",
               str(self.cp), f"{p}pipeline_parallel_degree", str(self.pp), f"{p}expert_parallel_degree", str(self.ep)]
        if self.pp > 1:
            out += [f"{p}pipeline_parallel_schedule", self.schedule, f"{p}pipeline_parallel_microbatch_size",
                    str(self.microbatch), f"{p}pipeline_parallel_layers_per_stage", "0"]
        out += ["--training.local_batch_size", str(self.local_batch), "--activation_checkpoint.mode",
                self.ac.split("_")[0]]
        if self.ac != "none" and self.ac != "full":
            out += ["--activation_checkpoint.selective_type", self.ac.split("_")[1]]
        return out

    def describe(self) -> str:
        dims = [f"{k} {v}" for k, v in (("pp", self.pp), ("dp_replicate", self.dp_replicate),
                                         ("dp_shard", self.dp_shard), ("cp", self.cp), ("tp", self.tp),
                                         ("ep", self.ep)) if v > 1] or ["1 GPU"]
        pipe = f", {self.schedule} mb {self.microbatch}" if self.pp > 1 else ""
        return f"{' x '.join(dims)}{pipe}, batch {self.local_batch}, AC {self.ac}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(plan: Plan, ngpu: int, gpus_per_node: int, seq_len: int) -> list[Layout]:
    """Every layout of `ngpu` ranks that keeps the plan's global batch and passes the cheap
    checks (heads split by tp, the sequence by tp x cp, blocks by pp, experts by ep)."""
    args, out = plan.args, []
    experts = getattr(getattr(args, "moe", None), "num_experts", 0)
    for tp in _divisors(gpus_per_node):
        if args.n_heads % tp or args.n_kv_heads % tp or ngpu % tp:
            continue
        for cp in _divisors(ngpu // tp):
            if cp > 1 and seq_len % (2 * cp * tp) or seq_len % (cp * tp):
                continue
            for pp in _divisors(ngpu // (tp * cp)):
                dp = ngpu // (tp * cp * pp)
                if pp > 1 and 2 * pp > args.n_layers or plan.global_batch_size % dp:
                    continue
                local = plan.global_batch_size // dp
                for rep in _divisors(dp):
                    eps = [e for e in _divisors(dp // rep * cp) if experts % e == 0] if experts else [1]
                    for ep, ac in ((e, a) for e in eps for a in AC_MODES):
                        for sched, mb in _pipelines(pp, local):
                            out.append(Layout(rep, dp // rep, tp, cp, pp, ep, sched, mb, local, ac))
    return out


def _pipelines(pp: int, local: int) -> list[tuple[str, int]]:
    """(schedule, micro-batch size) pairs: at least as many micro-batches as pipeline ranks."""
    if pp == 1:
        return [("1F1B", local)]
    return [(s, mb) for s in SCHEDULES for mb in (1, 2) if local % mb == 0 and local // mb >= pp
            and (s != "Interleaved1F1B" or local // mb % pp == 0)]


@dataclass(frozen=True)
class Bound:
    peak_bytes: float
    """Below the traced peak: sharded model state, what FSDP gathers, what blocks keep for backward."""
    tokens_per_sec_per_gpu: float
    """Above the prediction: the step's FLOPs at the fitted matmul rate or FSDP's traffic, the
    exposed TP and CP traffic at link speed, the bubble."""


def bound(lay: Layout, plan: Plan, seq_len: int, gpu: hardware.GPU, gpus_per_node: int) -> Bound:
    args, ngpu = plan.args, lay.dp_replicate * lay.dp_shard * lay.tp * lay.cp * lay.pp
    shard = lay.dp_shard * lay.cp  # FSDP shards over dp_shard x cp
    stage_params = plan.n_params / (lay.tp * lay.pp)
    vocab = args.vocab_size * args.dim / lay.tp  # the embedding's, or the output layer's, share
    block = (plan.n_params - 2 * args.vocab_size * args.dim) / args.n_layers / lay.tp
    micro = lay.local_batch // lay.microbatch
    tokens = lay.microbatch * seq_len // lay.cp  # one micro-batch's tokens on one rank
    in_flight = 1 if lay.pp == 1 else min(micro, lay.pp)
    d, f = _SAVED[lay.ac]
    ffn = getattr(args, "ffn_hidden", 0) or 0
    saved = args.n_layers / lay.pp * in_flight * tokens * 2 * (d * args.dim + f * ffn) / lay.tp
    # fp32 parameters and gradients, AdamW's two moments: 16 bytes per parameter, sharded; one
    # block (or the embedding or output layer) gathered in bf16 with its fp32 gradient, or under
    # a pipeline the whole stage in bf16 with its bf16 gradients (FSDP keeps it gathered for
    # every micro-batch and reduces the gradients after the last); the logits
    gathered = 0.0 if shard == 1 else 4 * stage_params if lay.pp > 1 else 6 * max(block, vocab)
    peak = 16 * stage_params / shard + gathered + saved + tokens * args.vocab_size / lay.tp * 2
    step_tokens = plan.global_batch_size * seq_len
    compute = (plan.spec.flops_per_token(args, seq_len) * step_tokens / ngpu * _RECOMPUTE[lay.ac]
               / timing.matmul_bound(gpu))

    def link_s(nbytes: float, span: int) -> float:
        """`nbytes` at NCCL's bandwidth over a group of ranks `span` apart in the world."""
        fast = span <= gpus_per_node
        bw = gpu.nvlink_bytes_per_s if fast else gpu.network_bytes_per_s
        return nbytes / (bw * timing.LINK_EFFICIENCY["nvlink" if fast else "network"])

    # FSDP: each step gathers the stage's bf16 parameters and reduce-scatters fp32 gradients
    # (overlapped with compute, so a step takes at least the slower); HSDP all-reduces the shards
    fsdp = link_s(6 * stage_params * (shard - 1) / shard, shard * lay.tp) + link_s(
        8 * stage_params / shard * (lay.dp_replicate - 1) / lay.dp_replicate, ngpu // lay.pp)
    per_block = args.n_layers / lay.pp * micro
    # exposed in eager mode: sequence parallel's two all-gathers and two reduce-scatters of a
    # block's activations, forward and backward; context parallel's K/V gather and its gradient
    tp_s = link_s(8 * (lay.tp - 1) / lay.tp * tokens * args.dim * 2 * per_block, lay.tp)
    kv = 2 * args.n_kv_heads * args.head_dim * 2
    cp_s = link_s(2 * (lay.cp - 1) * tokens * kv * per_block, lay.cp * lay.tp)
    slots = micro * (2 if lay.schedule == "Interleaved1F1B" else 1)
    bubble = (slots + lay.pp - 1) / slots if lay.pp > 1 else 1.0
    return Bound(peak, step_tokens / ngpu / ((max(compute, fsdp) + tp_s + cp_s) * bubble))


def _shape(lay: Layout) -> tuple:
    """What sets a layout's time per token beyond its bound: its split of each sequence's work."""
    return lay.tp, lay.cp, lay.pp, lay.schedule, lay.microbatch, lay.ac


def layout_of(cfg: JobConfig, plan: Plan) -> Layout:
    """The layout a config runs with, as the planner writes it."""
    p, d, ac = cfg.parallelism, plan.dims, cfg.activation_checkpoint
    mode = ac.mode if ac.mode != "selective" else f"selective_{ac.selective_type}"
    sched, mb = ((p.pipeline_parallel_schedule, p.pipeline_parallel_microbatch_size) if d.pp > 1
                 else ("1F1B", cfg.training.local_batch_size))
    return Layout(d.dp_replicate, d.dp_shard, d.tp, d.cp, d.pp, d.ep, sched, mb, cfg.training.local_batch_size, mode)


def _base(argv: list[str], ngpu: int) -> tuple[JobConfig, Plan]:
    cfg, _ = config_load.load(argv)
    return cfg, make_plan(dry_config(cfg), ngpu, "cuda")


def search(argv: list[str], ngpu: int, gpu: hardware.GPU, gpus_per_node: int = 8, top: int = 5,
           max_traces: int = 8, log=partial(print, flush=True)) -> dict:
    """The planner: the best `top` layouts that fit, and what the search did."""
    start = time.perf_counter()
    cfg, plan = _base(argv, ngpu)
    limit = MARGIN * gpu.memory_gib * hardware.GIB
    cands = [(lay, bound(lay, plan, cfg.training.seq_len, gpu, gpus_per_node))
             for lay in layouts(plan, ngpu, gpus_per_node, cfg.training.seq_len)]
    # the config's own layout first: a layout that fits, to beat, and the bounds' first ratios
    own = layout_of(cfg, plan)
    fits = sorted((c for c in cands if c[1].peak_bytes <= limit),
                  key=lambda c: (c[0] != own, -c[1].tokens_per_sec_per_gpu))
    found, traced, stop, speed, memory, skipped = [], 0, "every candidate traced or ruled out", {}, {}, 0
    for lay, b in fits:
        kth = sorted((r["predicted"]["tokens_per_sec_per_gpu"] for r in found), reverse=True)[top - 1:top]
        # the bounds leave out what the trace sees (memory-bound ops, FSDP's traffic, latencies):
        # scale them by what traced layouts of the same shape showed, else by the most
        # optimistic ratio of any; memory by the least ratio per AC mode, with or without pipeline
        ratio = speed.get(_shape(lay), max(speed.values(), default=1.0))
        grown = memory.get((lay.ac, lay.pp > 1), min(memory.values(), default=1.0))
        if kth and b.tokens_per_sec_per_gpu * ratio < kth[0] or b.peak_bytes * grown > limit:
            skipped += 1
            continue
        if traced == max_traces:
            stop = f"{max_traces} layouts traced (--max-traces)"
            break
        try:
            job, _ = config_load.load([*argv, *lay.overrides()])
            rep = report(dry_run(job, ngpu), gpu)
        except ConfigError as e:
            log(f"  skipped {lay.describe()}: {e}")
            continue
        traced += 1
        peak = max(r["memory_gib"]["peak"] for r in rep["roles"]) * hardware.GIB
        tps = rep["predicted"]["tokens_per_sec_per_gpu"]
        speed[_shape(lay)] = max(speed.get(_shape(lay), 0.0), tps / b.tokens_per_sec_per_gpu)
        kind = lay.ac, lay.pp > 1
        memory[kind] = min(memory.get(kind, peak / b.peak_bytes), peak / b.peak_bytes)
        log(f"  traced {lay.describe()}: {tps:,.1f} tokens/s/GPU, peak {peak / hardware.GIB:.1f} GiB"
            f"{'' if peak <= limit else ' (does not fit)'}")
        if peak <= limit:
            found.append({"overrides": lay.overrides(), "describe": lay.describe(),
                          "parallelism": dataclasses.asdict(lay), "peak_gib": peak / hardware.GIB,
                          "predicted": {"tokens_per_sec_per_gpu": tps, "mfu_pct": rep["predicted"]["mfu_pct"]}})
    found.sort(key=lambda r: -r["predicted"]["tokens_per_sec_per_gpu"])
    if found:  # a warm-up's earlier phases on the best layout (its memory, planned above, is the last phase's)
        job, _ = config_load.load([*argv, *found[0]["overrides"]])
        found[0]["phases"] = phase_times(job, make_plan(dry_config(job), ngpu), ngpu,
                                         lambda j, n: report(dry_run(j, n), gpu))
    return {"layouts": found[:top], "gpu": gpu.name, "world_size": ngpu, "memory_limit_gib": limit / hardware.GIB,
            "searched": {"layouts": len(cands), "fit_by_bound": len(fits), "traced": traced,
                         "ruled_out_after_tracing": skipped, "stopped": stop,
                         "seconds": time.perf_counter() - start}}


def _parse(argv: list[str]) -> tuple[dict, list[str]]:
    opts = {"ngpu": None, "gpu": "h100", "gpus_per_node": "8", "top": "5", "out": None, "max_traces": "8"}
    if any(a.split("=")[0] == "--budget-s" for a in argv):
        raise ConfigError("--budget-s is gone: the planner is bounded by layouts traced, so its answer does not "
                          "depend on the machine's load; use --max-traces N (default 8)")
    rest = split_flags(argv, opts)
    for key in ("ngpu", "gpus_per_node", "top", "max_traces"):
        flag = f"--{key.replace('_', '-')}"
        if opts[key] is None:
            raise ConfigError(f"{flag} is required: the number of GPUs to plan for, e.g. {flag} 64")
        if not opts[key].isdigit() or int(opts[key]) < 1:
            raise ConfigError(f"{flag}: expected a positive integer, got '{opts[key]}'")
    return opts, rest


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv[:1]):
        return print(__doc__)
    try:
        opts, rest = _parse(argv)
        gpu = hardware.get_gpu(opts["gpu"])
        result = search(rest, int(opts["ngpu"]), gpu, int(opts["gpus_per_node"]), int(opts["top"]),
                        int(opts["max_traces"]))
    except ConfigError as e:
        sys.exit(print(f"titanlite: error: {e}", file=sys.stderr) or 2)
    s = result["searched"]
    print(f"{s['layouts']} layouts, {s['fit_by_bound']} not ruled out by the memory bound, {s['traced']} traced, "
          f"{s['ruled_out_after_tracing']} ruled out by the scaled bounds; stopped: {s['stopped']} ({s['seconds']:.0f} s)")
    print(f"best {len(result['layouts'])} on {result['world_size']} {gpu.name} (peak <= "
          f"{result['memory_limit_gib']:.1f} GiB):")
    for i, r in enumerate(result["layouts"], 1):
        p = r["predicted"]
        print(f"{i}. {r['describe']}: {p['tokens_per_sec_per_gpu']:,.1f} tokens/s/GPU, MFU {p['mfu_pct']:.1f}%, "
              f"peak {r['peak_gib']:.1f} GiB\n   {' '.join(r['overrides'])}")
        for phase in r.get("phases", ()):
            print(f"   warm-up {phase['describe']}: step {phase['step_s']:.3f} s")
    if opts["out"]:
        with open(opts["out"], "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
