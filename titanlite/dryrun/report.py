"""What a dry run's trace predicts on a GPU: the step time (eager and compiled, with the pipeline
bubble and the replica groups' share), tokens/s, MFU and memory against the GPU's, as JSON and as
the table `python -m titanlite.dryrun` prints. The trace (titanlite.dryrun.run) does not depend
on the GPU; this does.
"""

from __future__ import annotations

import dataclasses

from titanlite.dryrun import hardware, timing
from titanlite.dryrun.hardware import GIB
from titanlite.dryrun.steptrace import CATEGORIES, PHASES
from titanlite.errors import ConfigError


def bubble_of(result: dict) -> tuple[int, int]:
    """The schedule's bubble: (pp - 1) idle slots per micro-batches x stages per rank busy ones."""
    pipe = result["pipeline"]
    return (1, 1) if pipe is None else (result["layout"]["pp"], pipe["microbatches"] * pipe["stages"]
                                        // result["layout"]["pp"])


def replica_seconds(result: dict, gpu: hardware.GPU) -> float:
    """Replica groups (fault_tolerance): the quorum and the cross-group all-reduce of each rank's
    gradients, after the backward (titanlite.runtime.replicas)."""
    grads = max(role.peaks["optimizer"]["gradients"] for role in result["_roles"])
    return timing.replica_step_seconds(grads, result["config"].get("replica_groups", 1), gpu)


def step_seconds(result: dict, gpu: hardware.GPU, compiled: bool, k: timing.Factors = timing.FITTED) -> float:
    """The slowest role's step on `gpu`, eager or compiled (one trace times both), with factors `k`."""
    return max(role.times(gpu, compiled, k).step(*bubble_of(result)) for role in result["_roles"]) + replica_seconds(
        result, gpu)


def report(result: dict, gpu: hardware.GPU) -> dict:
    """The JSON report for one GPU (the roles' traces do not depend on it)."""
    plan, cfg, world = result["_plan"], result["config"], result["world_size"]
    tokens = cfg["global_batch_size"] * cfg["seq_len"]
    pipe, bubble = result["pipeline"], bubble_of(result)
    if cfg.get("float8") and gpu.mamf_f8_flops is None:
        raise ConfigError(f"float8.enable: the {gpu.name} has no float8 matmuls; plan it on an h100, h200 or b200, "
                          "or set --float8.enable false")
    roles, across = [], replica_seconds(result, gpu)
    times = {id(role): role.times(gpu, cfg["compile"]) for role in result["_roles"]}
    steps = {c: step_seconds(result, gpu, c) for c in (False, True)}
    step_s = steps[cfg["compile"]]
    for role in result["_roles"]:
        peaks, phase = role.peaks_as(cfg["compile"])
        peak = peaks[phase]
        roles.append({
            "rank": role.rank, "traced_blocks": role.traced_blocks, "copied_calls": role.copied_calls,
            "peak_phase": phase,
            "memory_gib": {**{c: peak[c] / GIB for c in CATEGORIES}, "peak": peak["total"] / GIB},
            "memory_gib_by_phase": {p: peaks[p]["total"] / GIB for p in PHASES},
            "peak_gib_eager": role.peaks[role.peak_phase]["total"] / GIB,
            "peak_gib_compiled": (lambda p, ph: p[ph]["total"])(*role.peaks_as(True)) / GIB,
            "collectives": {f"{k}[{g}] {p}": {"count": v["count"], "gib": v["bytes"] / GIB,
                                              "group_size": v["group_size"]}
                            for (k, g, p), v in sorted(role.comms.items())},
            "flops_per_step": role.flops,
            "eval_peak_gib": None if role.eval_peak is None else role.eval_peak / GIB,
            "step_s": times[id(role)].step(*bubble),
            "step_terms_s": dataclasses.asdict(times[id(role)])})
    tps = tokens / step_s / world
    mfu = 100 * tps * plan.spec.flops_per_token(plan.args, cfg["seq_len"]) / gpu.bf16_flops
    if pipe is not None:
        pipe = {**pipe, "bubble_factor": (bubble[1] + bubble[0] - 1) / bubble[1]}
    return {"world_size": world, "layout": result["layout"], "pipeline": pipe, "config": cfg,
            "block_kinds": result.get("block_kinds", {}), "roles": roles,
            "predicted": {"gpu": gpu.name, "power_w": gpu.power_w, "step_s": step_s, "replica_groups_s": across,
                          "tokens_per_sec_per_gpu": tps, "mfu_pct": mfu,
                          "memory_limit_gib": gpu.memory_gib,
                          "tokens_per_sec_per_gpu_eager": tokens / steps[False] / world,
                          "tokens_per_sec_per_gpu_compiled": tokens / steps[True] / world,
                          "fits": all(max(r["memory_gib"]["peak"], r["eval_peak_gib"] or 0) <= gpu.memory_gib
                                      for r in roles)}}


def print_table(rep: dict) -> None:
    lay, cfg, pred = rep["layout"], rep["config"], rep["predicted"]
    print(f"{cfg['model']} {cfg['flavor']} on {rep['world_size']} ranks: "
          + " x ".join(f"{k} {v}" for k, v in lay.items() if v > 1 or k == "dp_shard")
          + f"; batch {cfg['local_batch_size']} x {cfg['seq_len']} per rank, global {cfg['global_batch_size']},"
          f" AC {cfg['activation_checkpoint']}, {cfg['param_dtype']}, {'compiled' if cfg['compile'] else 'eager'}"
          + (f", float8 {cfg['float8']}" if cfg.get("float8") else ""))
    if len(rep.get("block_kinds", {})) > 1:
        print("blocks, each kind traced and counted apart: " + ", ".join(f"{k} x{n}" for k, n in rep["block_kinds"].items()))
    if cfg["attn_backend"] != "sdpa":
        print(f"attention: model.attn_backend {cfg['attn_backend']} traced as sdpa (its kernels cannot run on "
              "fake CPU tensors); memory and collectives are sdpa's, time a roofline of the same FLOPs")
    if rep["pipeline"]:
        pipe = rep["pipeline"]
        print(f"pipeline: {pipe['schedule']}, {pipe['stages']} stages of {min(pipe['blocks_per_stage'])}-"
              f"{max(pipe['blocks_per_stage'])} blocks, {pipe['microbatches']} micro-batches; bubble "
              f"x{pipe['bubble_factor']:.3f} on the busy time")
    for role in rep["roles"]:
        m = role["memory_gib"]
        print(f"rank {role['rank']} (traced {role['traced_blocks']} blocks, "
              f"{role['copied_calls']} pipeline calls copied, peak during {role['peak_phase']}):")
        for c in (*CATEGORIES, "peak"):
            print(f"  {c:<14} {m[c]:9.2f} GiB")
        print(f"  {'collective':<34} {'count':>7} {'GiB':>10}")
        for name, v in role["collectives"].items():
            print(f"  {name:<34} {v['count']:>7} {v['gib']:>10.3f}")
        print(f"  FLOPs per step {role['flops_per_step']:.4g}")
        if role["eval_peak_gib"] is not None:
            print(f"  evaluation ([eval], {cfg['eval_batch_size']} x {cfg['seq_len']} tokens, forward only): peak "
                  f"{role['eval_peak_gib']:.2f} GiB")
    print(f"predicted on {pred['gpu']} at {pred['power_w']:.0f} W: step {pred['step_s']:.3f} s, {pred['tokens_per_sec_per_gpu']:,.0f} "
          f"tokens/s/GPU, MFU {pred['mfu_pct']:.1f}%, peak memory "
          f"{max(r['memory_gib']['peak'] for r in rep['roles']):.1f} of {pred['memory_limit_gib']:.1f} GiB")
    if pred["replica_groups_s"]:
        print(f"  of which {pred['replica_groups_s']:.3f} s for the quorum and the gradients' all-reduce across "
              f"{cfg['replica_groups']} replica groups (this group's share of the global batch: 1/{cfg['replica_groups']})")
    for phase in rep.get("phases", ()):
        print(f"  warm-up {phase['describe']}: step {phase['step_s']:.3f} s, peak {phase['peak_gib']:.1f} GiB")
    other = "eager" if cfg["compile"] else "compiled"
    print(f"  the same step {other} (compile.enable {str(not cfg['compile']).lower()}): "
          f"{pred['tokens_per_sec_per_gpu_' + other]:,.0f} tokens/s/GPU")
