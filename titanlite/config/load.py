"""Loading the job config: defaults < TOML < command line, then strict checks.

`python -m titanlite.config.load ARGS` runs the checks without importing torch (run_train.sh's
first, sub-second check).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import inspect
import math
import os
import sys
import typing
from pathlib import Path

from titanlite.config.data import check_data, check_preference, parse_ranges
from titanlite.config.eval import check_eval
from titanlite.config.job import CHOICES, Checkpoint, JobConfig
from titanlite.config.rl import check_rl
from titanlite.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parents[1] / "train_configs"


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def _field_types(section: type) -> dict[str, type]:
    hints = typing.get_type_hints(section)
    return {f.name: hints[f.name] for f in dataclasses.fields(section)}


def field_docs(section: type) -> dict[str, str]:
    """Docstrings written under each field, read from the source (Python drops them)."""
    tree = ast.parse(inspect.getsource(section))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _nearest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else f"; valid: {', '.join(options)}"


def _coerce(key: str, value: object, typ: type, from_cli: bool) -> object:
    """Check (TOML) or parse (CLI string) one value against its declared type."""
    if typing.get_origin(typ) is list:
        (item,) = typing.get_args(typ)
        if from_cli and isinstance(value, str):
            value = [v for v in value.split(",") if v]  # CLI lists are comma-separated
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(key, v, item, from_cli) for v in value]
    name = getattr(typ, "__name__", str(typ))
    if from_cli and isinstance(value, str):
        try:
            if typ is bool:
                lowered = value.lower()
                if lowered not in ("true", "false", "1", "0"):
                    raise ValueError
                return lowered in ("true", "1")
            if typ is int:
                return int(value)
            if typ is float:
                return float(value)
        except ValueError:
            raise ConfigError(f"{key}: expected {name}, got '{value}'") from None
        return value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not typ:
        raise ConfigError(f"{key}: expected {name}, got {type(value).__name__} {value!r}")
    return value


def _set(values: dict, section: str, key: str, raw: object, from_cli: bool) -> None:
    sections = _sections()
    if section not in sections:
        raise ConfigError(f"unknown config section '{section}'{_nearest(section, list(sections))}")
    types = _field_types(sections[section])
    if key not in types:
        raise ConfigError(f"unknown config key '{section}.{key}'"
                          f"{_nearest(key, list(types))}")
    value = _coerce(f"{section}.{key}", raw, types[key], from_cli)
    for v in value if isinstance(value, list) else [value]:
        # float("nan") parses, and TOML has nan and inf: neither is a usable setting anywhere
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{section}.{key}: must be a finite number, got {v}")
    values.setdefault(section, {})[key] = value


def _read_toml(path: Path) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib  # tomli, in the standard library since 3.11
    else:
        import tomli as tomllib

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def resolve_config_path(name: str) -> Path:
    """A path as given, else a bare file name looked up in train_configs/."""
    path = Path(name)
    if path.is_file():
        return path
    if path.parent == Path(".") and (CONFIG_DIR / name).is_file():
        return CONFIG_DIR / name
    raise ConfigError(f"config file '{name}' not found (looked in . and {CONFIG_DIR}); "
                      "pass a path or a file name in train_configs/")


def _parse_cli(argv: list[str]) -> tuple[str | None, list[tuple[str, str]], set[str]]:
    config, pairs, flags = None, [], set()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--help", "-h", "--print-config", "--check"):
            flags.add(arg)
            i += 1
            continue
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}'; options look like --section.key value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
                i += 1
            else:
                value = "true"  # a bare flag switches a bool on; other types reject it
        i += 1
        if name in ("config", "job.config_file"):
            config = value
        elif "." not in name:
            raise ConfigError(f"option '--{name}' must look like --section.key"
                              f"{_nearest(name, list(_sections()))}")
        else:
            pairs.append((name, value))
    return config, pairs, flags


def load(argv: list[str]) -> tuple[JobConfig, set[str]]:
    """Build the JobConfig from `--config FILE` and `--section.key value` overrides."""
    config, pairs, flags = _parse_cli(argv)
    values: dict[str, dict] = {}
    if config is not None:
        path = resolve_config_path(config)
        for section, table in _read_toml(path).items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: '{section}' must be a [section] table")
            for key, raw in table.items():
                _set(values, section, key, raw, from_cli=False)
    for name, raw in pairs:
        section, _, key = name.partition(".")
        _set(values, section, key, raw, from_cli=True)
    sections = _sections()
    cfg = JobConfig(**{s: sections[s](**values.get(s, {})) for s in sections})
    check_config(cfg)
    return cfg, flags


def _check_choices(cfg: JobConfig) -> None:
    """Every key of CHOICES holds one of its allowed values (each element, for a list)."""
    for key, options in CHOICES.items():
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section), name)
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if v not in options:
                raise ConfigError(f"{key}: '{v}' is not one of {', '.join(options)}")


def check_config(cfg: JobConfig) -> None:
    """Checks that need no world size, model or files; everything else is checked where known."""
    t, p, s = cfg.training, cfg.parallelism, cfg.lr_scheduler
    for key, val in [("training.steps", t.steps), ("training.seq_len", t.seq_len),
                     ("training.local_batch_size", t.local_batch_size),
                     ("metrics.log_freq", cfg.metrics.log_freq),
                     ("metrics.straggler_logs", cfg.metrics.straggler_logs),
                     ("parallelism.data_parallel_replicate_degree", p.data_parallel_replicate_degree),
                     ("parallelism.tensor_parallel_degree", p.tensor_parallel_degree),
                     ("parallelism.context_parallel_degree", p.context_parallel_degree),
                     ("parallelism.pipeline_parallel_degree", p.pipeline_parallel_degree),
                     ("parallelism.pipeline_parallel_microbatch_size", p.pipeline_parallel_microbatch_size),
                     ("parallelism.expert_parallel_degree", p.expert_parallel_degree),
                     ("activation_checkpoint.selective_every", cfg.activation_checkpoint.selective_every),
                     ("comm.init_timeout_s", cfg.comm.init_timeout_s),
                     ("comm.train_timeout_s", cfg.comm.train_timeout_s),
                     ("comm.save_timeout_s", cfg.comm.save_timeout_s),
                     ("comm.validation_timeout_s", cfg.comm.validation_timeout_s),
                     ("comm.eval_timeout_s", cfg.comm.eval_timeout_s),
                     ("job.shutdown_timeout_s", cfg.job.shutdown_timeout_s),
                     ("profiling.start_step", cfg.profiling.start_step),
                     ("profiling.num_steps", cfg.profiling.num_steps)]:
        if val < 1:
            raise ConfigError(f"{key} must be >= 1, got {val}")
    _check_choices(cfg)
    if cfg.comm.train_timeout_s > cfg.comm.init_timeout_s:
        raise ConfigError(f"comm.train_timeout_s {cfg.comm.train_timeout_s} is longer than comm.init_timeout_s "
                          f"{cfg.comm.init_timeout_s} (set-up and the first step); raise comm.init_timeout_s too")
    if p.data_parallel_shard_degree < 1 and p.data_parallel_shard_degree != -1:
        raise ConfigError("parallelism.data_parallel_shard_degree must be >= 1 or -1 (the rest of "
                          f"the world), got {p.data_parallel_shard_degree}")
    if t.global_batch_size < 1 and t.global_batch_size != -1:
        raise ConfigError(f"training.global_batch_size must be >= 1 or -1, got {t.global_batch_size}")
    o = cfg.optimizer
    if o.lr <= 0:
        raise ConfigError(f"optimizer.lr must be > 0, got {o.lr}")
    for key, val in [("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)]:
        if not 0.0 <= val < 1.0:
            raise ConfigError(f"{key} must be in [0, 1), got {val}")
    for key, val in [("optimizer.eps", o.eps), ("optimizer.weight_decay", o.weight_decay),
                     ("model.vocab_size", cfg.model.vocab_size), ("training.z_loss", t.z_loss)]:
        if val < 0:
            raise ConfigError(f"{key} must be >= 0, got {val}")
    if cfg.data.num_workers < 0:
        raise ConfigError(f"data.num_workers must be >= 0, got {cfg.data.num_workers}")
    # more workers than CPUs only adds processes and memory (the fuzzer's 99999999999 was SIGKILLed)
    if cfg.data.num_workers > (os.cpu_count() or 1):
        raise ConfigError(f"data.num_workers {cfg.data.num_workers} is more than this machine's "
                          f"{os.cpu_count()} CPUs; use at most that many")
    # checked even while pipelining is off: a negative count is a mistake whatever the layout
    for key in ("layers_per_stage", "first_stage_less_layers", "last_stage_less_layers"):
        if getattr(p, f"pipeline_parallel_{key}") < 0:
            raise ConfigError(f"parallelism.pipeline_parallel_{key} must be >= 0, "
                              f"got {getattr(p, f'pipeline_parallel_{key}')}")
    if not 0.0 <= cfg.data.holdout_fraction < 1.0:
        raise ConfigError(f"data.holdout_fraction must be in [0, 1), got {cfg.data.holdout_fraction}")
    if not 0.0 <= o.muon_momentum < 1.0:
        raise ConfigError(f"optimizer.muon_momentum must be in [0, 1), got {o.muon_momentum}")
    if o.muon_ns_steps < 1:
        raise ConfigError(f"optimizer.muon_ns_steps must be >= 1 (5 is usual), got {o.muon_ns_steps}")
    if o.muon_lr <= 0 and o.muon_lr != -1:
        raise ConfigError(f"optimizer.muon_lr must be > 0 or -1 (optimizer.lr), got {o.muon_lr}")
    if o.muon_weight_decay < 0 and o.muon_weight_decay != -1:
        raise ConfigError("optimizer.muon_weight_decay must be >= 0 or -1 (optimizer.weight_decay), "
                          f"got {o.muon_weight_decay}")
    if t.on_spike == "rollback" and (not cfg.checkpoint.enable or cfg.checkpoint.load_step != -1):
        raise ConfigError("training.on_spike = rollback goes back to the newest checkpoint; set checkpoint.enable = "
                          "true and leave checkpoint.load_step at -1")
    if t.spike_rollback_after < 1:
        raise ConfigError(f"training.spike_rollback_after must be >= 1, got {t.spike_rollback_after}")
    parse_ranges(cfg.data.skip_samples)
    if cfg.data.streaming and (cfg.data.skip_samples or t.on_spike == "rollback"):
        raise ConfigError("data.skip_samples and training.on_spike = rollback need a sample order; "
                          "data.streaming has none: turn streaming off or leave them out")
    if t.spike_window < 2 or not t.spike_sigmas > 0:
        raise ConfigError(f"training.spike_window must be >= 2 and training.spike_sigmas > 0, got "
                          f"{t.spike_window} and {t.spike_sigmas}")
    if cfg.metrics.straggler_ratio < 0 or 0 < cfg.metrics.straggler_ratio <= 1:
        raise ConfigError(f"metrics.straggler_ratio must be 0 (off) or > 1, got {cfg.metrics.straggler_ratio}")
    if t.max_skipped_steps < 0:
        raise ConfigError(f"training.max_skipped_steps must be >= 0, got {t.max_skipped_steps}")
    pr = cfg.profiling
    if pr.enable and pr.start_step + pr.num_steps - 1 > t.steps:
        raise ConfigError(f"profiling: the window of steps {pr.start_step}..{pr.start_step + pr.num_steps - 1} "
                          f"ends after training.steps ({t.steps}); lower profiling.start_step or num_steps")
    for key, val in [("moe.aux_loss_coeff", cfg.moe.aux_loss_coeff),
                     ("moe.bias_update_rate", cfg.moe.bias_update_rate)]:
        if val < 0:
            raise ConfigError(f"{key} must be >= 0, got {val}")
    if t.gc_freq < 0:
        raise ConfigError(f"training.gc_freq must be >= 0 (0 = automatic), got {t.gc_freq}")
    if s.warmup_steps < 0 or not 0.0 <= s.decay_ratio <= 1.0 or not 0.0 <= s.min_lr_factor <= 1.0:
        raise ConfigError("lr_scheduler: need warmup_steps >= 0 and decay_ratio, min_lr_factor in [0, 1]")
    check_data(cfg.data, cfg.validation)
    if cfg.rl.enable and cfg.lora.rank > 0 and cfg.lora.dropout > 0:
        raise ConfigError(f"lora.dropout {cfg.lora.dropout} with rl.enable: GRPO's ratio compares the policy's log-probs "
                          "with its old ones, and a dropout draw would move it off 1 where the policy has not; "
                          "set lora.dropout = 0 (TRL turns dropout off for GRPO too)")
    if cfg.rl.enable and cfg.data.format == "preference":
        raise ConfigError("rl.enable: a GRPO run's data are its rollouts, not preference pairs; "
                          "set data.format = \"text\" (or \"chat\") or rl.enable = false")
    pp = cfg.parallelism
    check_preference(cfg.preference, cfg.data, cfg.lora.rank > 0, t.z_loss, bool(t.seq_warmup),
                     pp.pipeline_parallel_schedule if pp.pipeline_parallel_degree > 1 else "")
    check_eval(cfg.eval)
    if cfg.data.tokenizer not in ("byte", "byte_chat") and not Path(cfg.data.tokenizer).is_dir():
        raise ConfigError(f"data.tokenizer: '{cfg.data.tokenizer}' is not 'byte', 'byte_chat' or a folder")
    c = cfg.checkpoint
    if c.interval < 1 or c.keep_latest_k < 0 or c.load_step < -1:
        raise ConfigError(f"checkpoint: need interval >= 1 (got {c.interval}), keep_latest_k >= 0 "
                          f"(got {c.keep_latest_k}) and load_step >= -1 (got {c.load_step})")
    if c.merge_last < 0 or c.merge_last > c.interval or (c.merge_last and not c.enable):
        raise ConfigError(f"checkpoint.merge_last {c.merge_last}: need 0 (off) or 1 .. checkpoint.interval "
                          f"({c.interval}) steps, and checkpoint.enable = true (the average is saved with the weights)")
    if c.load_step != -1 and not c.enable:
        raise ConfigError(f"checkpoint.load_step {c.load_step} is set but checkpoint.enable is false; "
                          "set checkpoint.enable = true to resume from it")
    _check_lora(cfg)
    check_rl(cfg.rl, c.interval, cfg.validation.freq)
    _check_replicas(cfg)
    _check_restarts(cfg.fault_tolerance.max_restarts, c, cfg.fault_tolerance.enable)
    _check_rerun(cfg)
    if not c.folder or Path(c.folder).is_absolute() or ".." in Path(c.folder).parts:
        raise ConfigError(f"checkpoint.folder: '{c.folder}' must be a relative path inside job.dump_folder")
    if c.initial_load_path and not Path(c.initial_load_path).is_dir():
        raise ConfigError(f"checkpoint.initial_load_path: '{c.initial_load_path}' is not a folder")


def _check_lora(cfg: JobConfig) -> None:
    """[lora]'s own values, and what a LoRA run cannot do (its targets are checked on the model, in preflight)."""
    lo = cfg.lora
    if lo.rank < 0 or lo.alpha <= 0 or not 0.0 <= lo.dropout < 1.0 or (lo.rank and not lo.target_modules):
        raise ConfigError(f"lora: need rank >= 0 (0: off), alpha > 0, dropout in [0, 1) and target_modules (e.g. "
                          f"wq,wv), got rank {lo.rank}, alpha {lo.alpha}, dropout {lo.dropout}, {lo.target_modules}")
    adapter = Path(lo.initial_adapter) / "adapter_config.json"
    if lo.initial_adapter and (not lo.rank or not adapter.is_file()):
        raise ConfigError(f"lora.initial_adapter: '{lo.initial_adapter}' needs lora.rank > 0 (its r) and a PEFT folder "
                          "(with adapter_config.json)")
    if lo.export_folder and (Path(lo.export_folder).is_absolute() or ".." in Path(lo.export_folder).parts):
        raise ConfigError(f"lora.export_folder: '{lo.export_folder}' must be a relative path inside job.dump_folder")
    for key, on, why in [
            ("float8.enable", cfg.float8.enable, "float8 base weights are not supported yet (untested: no GPU)"),
            ("moe.bias_update_rate", cfg.moe.bias_update_rate > 0, "it moves the frozen routers' selection bias, "
                                                                 "which neither the adapter checkpoint nor PEFT holds"),
            ("checkpoint.export_dtype", bool(cfg.checkpoint.export_dtype), "the run exports its adapter "
                                                                          "(lora.export_folder); convert dcp hf merges it"),
            ("checkpoint.create_seed_checkpoint", cfg.checkpoint.create_seed_checkpoint,
             "its base weights come from checkpoint.initial_load_path or the seed"),
            # averaging A and B apart is not averaging B @ A, and the sum would hold the frozen base too
            ("checkpoint.merge_last", cfg.checkpoint.merge_last > 0, "the mean of the adapters' A and B is not the "
                                                                     "adapter of the mean; merge the run's checkpoints "
                                                                     "offline (python -m titanlite.tools.merge CKPT "
                                                                     "... OUT: each is its base + scale B A)")]:
        if on and lo.rank:
            raise ConfigError(f"{key} with lora.rank {lo.rank}: {why}; set {key} off or lora.rank 0")


def _check_replicas(cfg: JobConfig) -> None:
    """Replica groups (fault_tolerance.enable): torchft installed, a lighthouse, a consistent group."""
    f, p = cfg.fault_tolerance, cfg.parallelism
    if not f.enable:
        return
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError("fault_tolerance.enable needs torchft, which is not installed: pip install 'titanlite[ft]'")
    if not f.lighthouse and not os.environ.get("TORCHFT_LIGHTHOUSE"):
        raise ConfigError("fault_tolerance.enable needs the lighthouse's address: set fault_tolerance.lighthouse "
                          "or TORCHFT_LIGHTHOUSE (http://host:port; docs/reliability.md)")
    if not (f.group_size >= 1 and 0 <= f.replica_id < f.group_size and 1 <= f.min_replica_size <= f.group_size):
        raise ConfigError(f"fault_tolerance: need 0 <= replica_id < group_size and 1 <= min_replica_size <= "
                          f"group_size, got replica_id {f.replica_id}, group_size {f.group_size}, "
                          f"min_replica_size {f.min_replica_size}")
    if not 0 < f.timeout_s < cfg.comm.train_timeout_s:
        # a group waiting on a hung peer must give up on it before its own watchdog ends it
        raise ConfigError(f"fault_tolerance.timeout_s must be > 0 and below comm.train_timeout_s "
                          f"({cfg.comm.train_timeout_s}), got {f.timeout_s}")
    # the groups are the replicate dimension; each group's steps draw rows by sample index
    for key, val in [("parallelism.data_parallel_replicate_degree", p.data_parallel_replicate_degree),
                     ("parallelism.pipeline_parallel_degree", p.pipeline_parallel_degree)]:
        if val != 1:
            raise ConfigError(f"fault_tolerance.enable with {key} {val}: replica groups replicate across "
                              "groups, and pipeline stages are not wired to them; set it to 1")
    if cfg.training.on_spike != "off":
        # a healed group's spike window would start empty and judge steps unlike its peers'
        raise ConfigError(f"fault_tolerance.enable with training.on_spike = {cfg.training.on_spike}: replica "
                          "groups do not share the spike window; set training.on_spike = off")
    if cfg.data.streaming:
        raise ConfigError("fault_tolerance.enable splits each global batch by sample index; data.streaming has "
                          "no sample order: turn streaming off")


def _check_restarts(max_restarts: int, c: Checkpoint, replicas: bool = False) -> None:
    if max_restarts < 0:
        raise ConfigError(f"fault_tolerance.max_restarts must be >= 0, got {max_restarts}")
    # a replica group restarted by torchrun heals from a live peer, not from its own checkpoint
    if max_restarts and not c.enable and not replicas:
        raise ConfigError(f"fault_tolerance.max_restarts {max_restarts} needs checkpoint.enable = true: a restart "
                          "resumes from the newest checkpoint, and without one would start over")
    if max_restarts and c.load_step != -1:
        # going back to load_step after a failure would redo (and re-save) every step since
        raise ConfigError(f"fault_tolerance.max_restarts {max_restarts} with checkpoint.load_step {c.load_step}: a "
                          "restart resumes from the newest checkpoint, not a fixed step; resume from it once with "
                          "max_restarts 0, or move the checkpoints after it away and leave load_step at -1")


def _check_rerun(cfg: JobConfig) -> None:
    f = cfg.fault_tolerance
    if not f.rerun_on_nonfinite:
        return
    if not f.max_restarts:
        raise ConfigError("fault_tolerance.rerun_on_nonfinite reruns a non-finite step in a restarted attempt; "
                          "set fault_tolerance.max_restarts >= 1")
    if cfg.training.on_nonfinite != "stop":
        raise ConfigError(f"fault_tolerance.rerun_on_nonfinite reruns the step a non-finite stop ended; "
                          f"training.on_nonfinite = {cfg.training.on_nonfinite} never stops: set it to stop")
    if f.enable:
        raise ConfigError("fault_tolerance.rerun_on_nonfinite reruns a step from the newest checkpoint; a replica "
                          "group heals from its peers instead: turn one of them off")


def to_toml(cfg: JobConfig) -> str:
    """The merged configuration as TOML text."""
    def fmt(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return repr(v)

    out = []
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        out.append(f"[{f.name}]")
        out += [f"{k} = {fmt(v)}" for k, v in dataclasses.asdict(section).items()]
        out.append("")
    return "\n".join(out)


def help_text() -> str:
    lines = ["usage: python -m titanlite.train [--config FILE] [--section.key VALUE ...] "
             "[--print-config] [--check] [--help]",
             "  --print-config  print the merged config as TOML and exit",
             "  --check         validate config, layout, model and data paths, then exit", ""]
    for name, section in _sections().items():
        lines.append(f"[{name}]")
        docs = field_docs(section)
        for f in dataclasses.fields(section):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  --{name}.{f.name} (default: {default!r})\n      {docs.get(f.name, '')}")
    return "\n".join(lines)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def world_rank() -> int:
    return int(os.environ.get("RANK", "0"))


if __name__ == "__main__":
    # run_train.sh's first check, without importing torch: most mistakes fail in well under a second
    try:
        load(sys.argv[1:])
    except ConfigError as e:
        print(f"titanlite: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
