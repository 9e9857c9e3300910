"""Job configuration: dataclass sections, TOML + command-line loading, strict validation.

Precedence is defaults < TOML < command line. Every field carries a docstring, which
`--help` prints. Functions elsewhere take only the section(s) they need.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent.parent / "train_configs"


class ConfigError(ValueError):
    """A user mistake in the configuration or command line; reported as one line."""


@dataclass(frozen=True)
class Job:
    dump_folder: str = "./outputs"
    """Folder for metrics, TensorBoard events and checkpoints."""
    run_name: str = ""
    """TensorBoard run name under <dump_folder>/tb/; empty means a timestamp."""
    description: str = ""
    """Free text shown at start-up."""
    shutdown_timeout_s: int = 25
    """After SIGTERM/SIGINT, seconds the ranks have to finish the step, save and exit 0;
    past it they exit non-zero. Keep it below the launcher's grace period (torchrun: 30 s)."""


@dataclass(frozen=True)
class Model:
    name: str = "llama3"
    """Model family: a folder under models/ that exports SPEC."""
    flavor: str = "debugmodel"
    """Size preset from the family's `flavors`."""
    vocab_size: int = 0
    """Embedding rows; 0 keeps the flavor's value. Must cover the tokenizer."""


@dataclass(frozen=True)
class Training:
    steps: int = 100
    """Number of optimizer steps."""
    seq_len: int = 256
    """Tokens per sample."""
    local_batch_size: int = 8
    """Samples per micro-batch on one data-parallel rank."""
    global_batch_size: int = -1
    """Samples per optimizer step over all ranks; -1 means local_batch_size x dp degree.
    A multiple of that product turns on gradient accumulation."""
    max_norm: float = 1.0
    """Gradient clipping threshold on the global L2 norm; <= 0 disables clipping."""
    seed: int = 0
    """Seed for weight init and dropout-free randomness."""
    deterministic: bool = False
    """Use deterministic algorithms (slower)."""
    mixed_precision_param: str = "auto"
    """Parameter dtype in forward/backward: auto (bfloat16 on GPU, float32 on CPU), float32 or bfloat16."""
    mixed_precision_reduce: str = "float32"
    """Gradient reduction dtype: float32 or bfloat16."""
    device: str = "auto"
    """auto (CUDA if present, else CPU), cuda or cpu."""
    on_nonfinite: str = "stop"
    """A step with a non-finite loss or gradient norm: stop (error naming the step) or skip
    (no optimizer update; the data and LR schedule still advance)."""
    max_skipped_steps: int = 10
    """With on_nonfinite = skip, the most steps a run may skip; one more stops it."""
    gc_freq: int = 50
    """Run Python's garbage collector by hand every N steps (automatic collection is switched
    off during training, so pauses land on known steps); 0 leaves Python's automatic collection on."""


@dataclass(frozen=True)
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicas for HSDP (gradients all-reduced across replicas)."""
    data_parallel_shard_degree: int = -1
    """FSDP shard degree; -1 means whatever is left of the world size."""
    tensor_parallel_degree: int = 1
    """Tensor (and sequence) parallel degree."""
    context_parallel_degree: int = 1
    """Context parallel degree (sequence sharding across ranks)."""
    fsdp_reshard_after_forward: str = "default"
    """default (reshard all but the root), always, or never (ZeRO-2 style)."""
    loss_parallel: bool = True
    """With tensor parallelism, compute the cross-entropy on vocab-sharded logits instead of
    gathering them on every rank; no effect when tensor_parallel_degree is 1."""
    sequence_parallel: bool = True
    """With tensor parallelism, also shard the sequence between blocks (norms, residual
    stream), cutting activation memory by the degree; needs training.seq_len divisible by
    the degree. Off keeps whole sequences on every tensor-parallel rank."""


@dataclass(frozen=True)
class Optimizer:
    name: str = "AdamW"
    """Only AdamW is supported."""
    lr: float = 8e-4
    """Peak learning rate."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    implementation: str = "fused"
    """fused (one kernel per step for all parameters) or foreach (a few multi-tensor kernels
    per update term; each reads and writes the whole optimizer state again)."""


@dataclass(frozen=True)
class LRScheduler:
    warmup_steps: int = 10
    """Linear warm-up steps from near zero to the peak LR."""
    decay_ratio: float = 1.0
    """Fraction of the post-warm-up steps spent decaying at the end; the steps between
    warm-up and decay hold the peak LR (warmup-stable-decay)."""
    decay_type: str = "linear"
    """linear or cosine."""
    min_lr_factor: float = 0.1
    """LR at the end of decay, as a fraction of the peak."""


@dataclass(frozen=True)
class Checkpoint:
    enable: bool = False
    """Save and resume distributed checkpoints."""
    folder: str = "checkpoint"
    """Checkpoint folder under job.dump_folder; each save is a step-N subfolder."""
    interval: int = 500
    """Save every N optimizer steps; the final step is always saved."""
    keep_latest_k: int = 0
    """Keep only the newest K complete checkpoints; 0 keeps all."""
    load_step: int = -1
    """Resume from this step's checkpoint; -1 means the latest complete one."""
    async_mode: str = "disabled"
    """disabled (block until written) or async (write in a background thread; training
    waits only for the in-memory copy before the next optimizer step)."""
    initial_load_path: str = ""
    """Weights to start from when the checkpoint folder has no checkpoint yet (model only;
    optimizer, schedule and data start fresh)."""
    initial_load_format: str = "dcp"
    """Format of initial_load_path: dcp (a titanlite checkpoint folder) or hf (a folder with
    config.json and safetensors written by transformers)."""
    create_seed_checkpoint: bool = False
    """Write the initial weights as step-0 (model only) on one process and exit; any layout
    that starts from it gets the same weights."""
    export_dtype: str = ""
    """If set (float32, bfloat16 or float16), the last step also writes a model-only copy in
    this dtype to <folder>/export-step-N for inference."""
    on_save_error: str = "stop"
    """A save that fails (full disk, unwritable folder): stop (exit 1) or continue training
    without it. Either way the previous checkpoint is kept and the partial one removed."""


@dataclass(frozen=True)
class Metrics:
    log_freq: int = 10
    """Log every N steps (and the first and last step)."""
    enable_tensorboard: bool = True
    """Write TensorBoard event files."""


@dataclass(frozen=True)
class Data:
    path: str = ""
    """A .txt/.jsonl file or a folder of them; empty means the embedded Python
    standard-library source."""
    text_field: str = "text"
    """Field holding the text in .jsonl records."""
    tokenizer: str = "byte"
    """byte (built in) or a folder with Hugging Face tokenizer files."""
    shuffle: bool = True
    """Shuffle samples with data.seed (layout-independent)."""
    seed: int = 0
    """Seed of the sample order."""
    num_workers: int = 0
    """Data loader worker processes."""
    holdout_fraction: float = 0.01
    """Tail fraction of the token stream kept out of training for validation."""
    split: str = "train"
    """Split to read from a Hugging Face data set (hf:NAME or a save_to_disk folder)."""
    mix: list[str] = field(default_factory=list)
    """Weighted mixture instead of data.path: ["SOURCE:WEIGHT", ...] (on the command line
    SOURCE:WEIGHT,SOURCE:WEIGHT); weights are relative, honoured to 1/1000. Each SOURCE is
    anything data.path accepts."""
    streaming: bool = False
    """Read data.path lazily (Hugging Face datasets streaming) instead of tokenizing it whole
    up front; see docs/data.md for what order guarantees hold."""
    shuffle_buffer: int = 10000
    """Documents in the shuffle buffer of a streamed source."""
    document_mask: bool = False
    """Attention stays within each document of a packed sample, and RoPE positions
    restart at each document (as if each ran alone)."""


@dataclass(frozen=True)
class Validation:
    freq: int = 0
    """Evaluate every N steps (and after the last); 0 turns validation off."""
    steps: int = 10
    """Global batches per evaluation (the same ones every time)."""
    path: str = ""
    """Validation source, anything data.path accepts; empty means the held-out tail
    (data.holdout_fraction) of the training data."""
    split: str = "validation"
    """Split of validation.path when it is a Hugging Face data set."""


@dataclass(frozen=True)
class ActivationCheckpoint:
    mode: str = "none"
    """none, full, or selective (see selective_type)."""
    selective_every: int = 2
    """With selective mode, checkpoint every N-th transformer block."""
    selective_type: str = "layer"
    """With selective mode: layer (every `selective_every`-th block recomputed whole) or op (every
    block keeps its matmul and attention outputs and recomputes the cheap ops between them)."""


@dataclass(frozen=True)
class Compile:
    enable: bool = False
    """torch.compile each transformer block (fullgraph) and the components listed below."""
    components: list[str] = field(default_factory=lambda: ["model"])
    """What to compile when enabled: model (each transformer block) and/or loss."""


@dataclass(frozen=True)
class Float8:
    enable: bool = False
    """Train the Linear layers inside transformer blocks in float8 through torchao
    (H100/H200-class CUDA GPUs; install the `float8` extra)."""
    enable_fsdp_float8_all_gather: bool = True
    """With FSDP, all-gather float8 weights instead of the parameter dtype (less traffic)."""
    recipe: str = "tensorwise"
    """torchao float8 scaling recipe: tensorwise, rowwise or rowwise_with_gw_hp."""


@dataclass(frozen=True)
class Comm:
    init_timeout_s: int = 300
    """Timeout for process-group creation and the first collectives."""
    train_timeout_s: int = 300
    """Seconds any training step after the first may take (collectives included); past it,
    every rank writes its stacks to <dump_folder>/hang/ and exits non-zero."""


@dataclass(frozen=True)
class Profiling:
    enable: bool = False
    """Record a torch profiler trace of a window of steps to
    <dump_folder>/profile/step-N/rankR.pt.trace.json (TensorBoard or Perfetto)."""
    start_step: int = 3
    """First profiled step (the steps before it are warm-up)."""
    num_steps: int = 2
    """Steps in the profiled window; N in step-N is its last step."""
    memory_snapshot: bool = False
    """On CUDA, record allocations and write a memory snapshot for the profiled window to
    <dump_folder>/memory_snapshot/step-N/rankR.pickle, and on out-of-memory to
    memory_snapshot/oom/rankR.pickle (view at pytorch.org/memory_viz)."""


@dataclass(frozen=True)
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    data: Data = field(default_factory=Data)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    comm: Comm = field(default_factory=Comm)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
    float8: Float8 = field(default_factory=Float8)


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
    values.setdefault(section, {})[key] = _coerce(f"{section}.{key}", raw, types[key], from_cli)


def _read_toml(path: Path) -> dict:
    import tomli

    try:
        with open(path, "rb") as f:
            return tomli.load(f)
    except tomli.TOMLDecodeError as e:
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
    validate(cfg)
    return cfg, flags


def _choice(key: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigError(f"{key}: '{value}' is not one of {', '.join(options)}")


def validate(cfg: JobConfig) -> None:
    """Checks that need no world size, model or files; everything else is checked where known."""
    t, p, s = cfg.training, cfg.parallelism, cfg.lr_scheduler
    for key, val in [("training.steps", t.steps), ("training.seq_len", t.seq_len),
                     ("training.local_batch_size", t.local_batch_size),
                     ("metrics.log_freq", cfg.metrics.log_freq),
                     ("parallelism.data_parallel_replicate_degree", p.data_parallel_replicate_degree),
                     ("parallelism.tensor_parallel_degree", p.tensor_parallel_degree),
                     ("parallelism.context_parallel_degree", p.context_parallel_degree),
                     ("activation_checkpoint.selective_every", cfg.activation_checkpoint.selective_every),
                     ("comm.init_timeout_s", cfg.comm.init_timeout_s),
                     ("comm.train_timeout_s", cfg.comm.train_timeout_s),
                     ("job.shutdown_timeout_s", cfg.job.shutdown_timeout_s),
                     ("profiling.start_step", cfg.profiling.start_step),
                     ("profiling.num_steps", cfg.profiling.num_steps)]:
        if val < 1:
            raise ConfigError(f"{key} must be >= 1, got {val}")
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
                     ("model.vocab_size", cfg.model.vocab_size)]:
        if val < 0:
            raise ConfigError(f"{key} must be >= 0, got {val}")
    if cfg.data.num_workers < 0:
        raise ConfigError(f"data.num_workers must be >= 0, got {cfg.data.num_workers}")
    if not 0.0 <= cfg.data.holdout_fraction < 1.0:
        raise ConfigError(f"data.holdout_fraction must be in [0, 1), got {cfg.data.holdout_fraction}")
    _choice("optimizer.name", cfg.optimizer.name, ("AdamW",))
    _choice("optimizer.implementation", cfg.optimizer.implementation, ("fused", "foreach"))
    _choice("training.mixed_precision_param", t.mixed_precision_param, ("auto", "float32", "bfloat16"))
    _choice("training.mixed_precision_reduce", t.mixed_precision_reduce, ("float32", "bfloat16"))
    _choice("training.device", t.device, ("auto", "cpu", "cuda"))
    _choice("parallelism.fsdp_reshard_after_forward", p.fsdp_reshard_after_forward,
            ("default", "always", "never"))
    _choice("lr_scheduler.decay_type", s.decay_type, ("linear", "cosine"))
    _choice("training.on_nonfinite", t.on_nonfinite, ("stop", "skip"))
    if t.max_skipped_steps < 0:
        raise ConfigError(f"training.max_skipped_steps must be >= 0, got {t.max_skipped_steps}")
    pr = cfg.profiling
    if pr.enable and pr.start_step + pr.num_steps - 1 > t.steps:
        raise ConfigError(f"profiling: the window of steps {pr.start_step}..{pr.start_step + pr.num_steps - 1} "
                          f"ends after training.steps ({t.steps}); lower profiling.start_step or num_steps")
    _choice("activation_checkpoint.mode", cfg.activation_checkpoint.mode, ("none", "full", "selective"))
    _choice("activation_checkpoint.selective_type", cfg.activation_checkpoint.selective_type, ("layer", "op"))
    for component in cfg.compile.components:
        _choice("compile.components", component, ("model", "loss"))
    _choice("float8.recipe", cfg.float8.recipe, ("tensorwise", "rowwise", "rowwise_with_gw_hp"))
    if t.gc_freq < 0:
        raise ConfigError(f"training.gc_freq must be >= 0 (0 = automatic), got {t.gc_freq}")
    if s.warmup_steps < 0 or not 0.0 <= s.decay_ratio <= 1.0 or not 0.0 <= s.min_lr_factor <= 1.0:
        raise ConfigError("lr_scheduler: need warmup_steps >= 0 and decay_ratio, min_lr_factor in [0, 1]")
    if s.warmup_steps >= t.steps:
        raise ConfigError(f"lr_scheduler.warmup_steps ({s.warmup_steps}) must be below training.steps "
                          f"({t.steps}); lower it or train longer")
    _validate_data(cfg.data, cfg.validation)
    if cfg.data.tokenizer != "byte" and not Path(cfg.data.tokenizer).is_dir():
        raise ConfigError(f"data.tokenizer: '{cfg.data.tokenizer}' is neither 'byte' nor a folder")
    c = cfg.checkpoint
    if c.interval < 1 or c.keep_latest_k < 0 or c.load_step < -1:
        raise ConfigError(f"checkpoint: need interval >= 1 (got {c.interval}), keep_latest_k >= 0 "
                          f"(got {c.keep_latest_k}) and load_step >= -1 (got {c.load_step})")
    if not c.folder or Path(c.folder).is_absolute() or ".." in Path(c.folder).parts:
        raise ConfigError(f"checkpoint.folder: '{c.folder}' must be a relative path inside job.dump_folder")
    _choice("checkpoint.async_mode", c.async_mode, ("disabled", "async"))
    _choice("checkpoint.on_save_error", c.on_save_error, ("stop", "continue"))
    _choice("checkpoint.initial_load_format", c.initial_load_format, ("dcp", "hf"))
    _choice("checkpoint.export_dtype", c.export_dtype, ("", "float32", "bfloat16", "float16"))
    if c.initial_load_path and not Path(c.initial_load_path).is_dir():
        raise ConfigError(f"checkpoint.initial_load_path: '{c.initial_load_path}' is not a folder")


def _validate_data(d: Data, v: Validation) -> None:
    from titanlite.sources import check_source, parse_mix

    if d.mix:
        if d.path:
            raise ConfigError("data.mix and data.path are both set; put every source in data.mix")
        if d.streaming:
            raise ConfigError("data.streaming does not support data.mix; mix local sources instead")
        for source, _ in parse_mix(d.mix):
            check_source(source, "data.mix")
    check_source(d.path)
    if d.streaming and not d.path:
        raise ConfigError("data.streaming needs data.path; the embedded source is read whole")
    if d.streaming and d.document_mask:
        raise ConfigError("data.document_mask needs document boundaries, which data.streaming does not "
                          "keep; turn one of them off")
    check_source(v.path, "validation.path")
    if d.shuffle_buffer < 1:
        raise ConfigError(f"data.shuffle_buffer must be >= 1, got {d.shuffle_buffer}")
    if v.freq < 0 or v.steps < 1:
        raise ConfigError(f"validation: need freq >= 0 and steps >= 1, got {v.freq} and {v.steps}")
    if v.freq and not v.path and d.holdout_fraction == 0:
        raise ConfigError("validation.freq is set but there is no validation data: set "
                          "data.holdout_fraction > 0 or validation.path")
    if v.freq and not v.path and d.streaming:
        raise ConfigError("validation.freq with data.streaming needs validation.path: a streamed "
                          "source has no held-out tail")


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
    import sys

    # the package's own module, not this __main__ copy: other modules raise its ConfigError
    from titanlite import config

    try:
        config.load(sys.argv[1:])
    except config.ConfigError as e:
        print(f"titanlite: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
