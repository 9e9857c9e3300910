"""Job configuration: one frozen dataclass per TOML section.

Every field carries a docstring, which `--help` prints. Functions elsewhere take only the
section(s) they need. Loading (defaults < TOML < command line) and the checks live in
titanlite.config.load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlite.config.data import Data, Preference, Validation
from titanlite.config.eval import Eval
from titanlite.config.rl import LOSS_NORMS, RL

@dataclass(frozen=True)
class Job:
    dump_folder: str = "./outputs"
    """Folder for metrics, TensorBoard events and checkpoints."""
    run_name: str = ""
    """Names the run's TensorBoard folder <dump_folder>/tb/<run_name> and its rows in
    <dump_folder>/metrics.jsonl (`run`); empty: <model>-<flavor>-<start time>."""
    description: str = ""
    """Free text shown at start-up."""
    shutdown_timeout_s: int = 25
    """After SIGTERM/SIGINT, seconds the ranks have to finish the step, save and exit 0;
    past it they exit non-zero. Keep it below the launcher's grace period (torchrun: 30 s)."""
    memory_check: str = "error"
    """Before launch, run_train.sh dry-runs one step and compares the per-rank peak with the
    device memory (CUDA: the GPU's; CPU: available host memory / local ranks): error refuses a
    job whose estimate exceeds it by more than 10%, warn only prints, off skips the check."""


@dataclass(frozen=True)
class Model:
    name: str = "llama3"
    """Model family: a folder under models/ that exports SPEC."""
    flavor: str = "debugmodel"
    """Size preset from the family's `flavors`."""
    vocab_size: int = 0
    """Embedding rows; 0 keeps the flavor's value. Must cover the tokenizer."""
    hf_config: str = ""
    """With model.name = transformers: the architecture, instead of a flavor: a folder with a
    transformers config.json (its weights load with checkpoint.initial_load_format = hf), or a
    model_type (llama, qwen3, gemma3, ...) built from transformers' defaults and hf_overrides.
    docs/transformers_models.md."""
    hf_overrides: list[str] = field(default_factory=list)
    """KEY=VALUE changes to model.hf_config's config (VALUE as JSON: 64, 1e-6, true, null,
    "text", [1, 2]), e.g. ["num_hidden_layers=2", "hidden_size=64"]; each KEY must exist there."""
    attn_backend: str = "sdpa"
    """Attention kernels: sdpa (flash for plain causal; masked blocks of queries otherwise), flex
    (FlexAttention, compiled on GPU; no backward on CPU) or varlen (CUDA, packed documents).
    docs/attention.md."""

    @property
    def variant(self) -> str:
        """What logs and reports call the architecture: model.hf_config when set, else the flavor."""
        return self.hf_config.rstrip("/").rpartition("/")[2] if self.hf_config else self.flavor


@dataclass(frozen=True)
class Training:
    steps: int = 100
    """Number of optimizer steps."""
    seq_len: int = 256
    """Tokens per sample."""
    seq_warmup: list[str] = field(default_factory=list)
    """Sequence-length warm-up: ["LEN:UNTIL", ...], sequences of LEN tokens until UNTIL (in
    warmup_unit), then the next entry's, then seq_len; each length divides the next and seq_len.
    A sample is read as seq_len / LEN rows of LEN tokens: the same tokens in the same order as
    without warm-up, a shorter context (docs/recipes.md). Not with pipeline parallelism."""
    seq_warmup_constant_tokens: bool = True
    """With seq_warmup: keep a step's tokens (the rows grow as the sequence shrinks); false keeps
    its rows (a shorter sequence reads fewer tokens per step)."""
    local_batch_size: int = 8
    """Samples per micro-batch on one data-parallel rank."""
    global_batch_size: int = -1
    """Samples per optimizer step over all ranks; -1 means local_batch_size x dp degree.
    A multiple of that product turns on gradient accumulation."""
    batch_warmup: list[str] = field(default_factory=list)
    """Batch-size warm-up: ["SIZE:UNTIL", ...], SIZE samples per step until UNTIL (in warmup_unit),
    then the next entry's, then global_batch_size; each size divides the next (e.g. doubling). The
    accumulation grows with the size (below local_batch_size x dp ranks, the local batch); the
    samples read are, in order, those of a run at global_batch_size (docs/recipes.md)."""
    batch_warmup_sqrt_lr: bool = False
    """With batch_warmup: the learning rate x sqrt(the step's tokens / the final step's), so it grows
    by sqrt(new / old) with the batch (Merrill et al. 2025); optimizer.lr is the final batch's."""
    warmup_unit: str = "steps"
    """What UNTIL counts in batch_warmup and seq_warmup: steps (an entry lasts through step UNTIL)
    or tokens (an entry lasts while fewer than UNTIL tokens were trained on before the step)."""
    max_norm: float = 1.0
    """Gradient clipping threshold on the global L2 norm; <= 0 disables clipping."""
    z_loss: float = 0.0
    """Weight of the z-loss, z_loss x logsumexp(logits)^2 averaged over the target tokens and added
    to the training loss (PaLM, OLMo 2: 1e-5), logged apart as z_loss (TensorBoard loss/z; loss stays
    the cross-entropy); 0 = off. docs/recipes.md."""
    seed: int = 0
    """Seed for weight init and dropout-free randomness."""
    deterministic: bool = False
    """Use deterministic algorithms (slower); on CUDA also cuBLAS's fixed workspace, cuDNN without
    autotuning and the math attention kernel (titanlite/runtime/determinism.py; not run on a GPU
    by the test suite)."""
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
    on_spike: str = "off"
    """A step whose global loss or gradient norm is more than spike_sigmas standard deviations
    above the mean of the last spike_window applied steps: off (applied as any other), skip
    (no optimizer update, as a skipped non-finite step; counted in skipped_steps and spike_steps),
    or rollback (skip, and see spike_rollback_after; needs checkpoint.enable)."""
    spike_window: int = 20
    """The applied steps a spike is measured against; no step is judged before the window is full."""
    spike_sigmas: float = 6.0
    """How many standard deviations above the window's mean make a spike."""
    spike_rollback_after: int = 3
    """With on_spike = rollback: this many spikes in a row send the run back to its newest
    checkpoint, the data of those steps skipped from then on (recorded in the checkpoint)."""
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
    expert_parallel_degree: int = 1
    """Expert parallel degree for MoE models: experts split over this many ranks, taken from
    data_parallel_shard_degree x context_parallel_degree (it must divide that product)."""
    fsdp_reshard_after_forward: str = "default"
    """default (reshard all but the root; never under pipeline parallelism, where a stage's
    parameters serve every micro-batch), always, or never (ZeRO-2 style)."""
    loss_parallel: bool = True
    """With tensor parallelism, compute the cross-entropy on vocab-sharded logits instead of
    gathering them on every rank; no effect when tensor_parallel_degree is 1."""
    sequence_parallel: bool = True
    """With tensor parallelism, also shard the sequence between blocks (norms, residual
    stream), cutting activation memory by the degree; needs training.seq_len divisible by
    the degree. Off keeps whole sequences on every tensor-parallel rank."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages' ranks (outermost mesh dimension); 1 turns pipelining off."""
    pipeline_parallel_schedule: str = "1F1B"
    """A torch.distributed.pipelining schedule: GPipe, 1F1B (one stage per rank), Interleaved1F1B,
    LoopedBFS, InterleavedZeroBubble (stages looped over the ranks), ZBVZeroBubble, DualPipeV
    (two stages per rank in a V)."""
    pipeline_parallel_microbatch_size: int = 1
    """Samples per pipeline micro-batch; the local batch is cut into local_batch_size / this many."""
    pipeline_parallel_layers_per_stage: int = 0
    """Blocks per stage, counting the embedding and the output layer as first/last_stage_less_layers
    blocks each; sets the stage count. 0: one stage per rank (two for multi-stage schedules)."""
    pipeline_parallel_first_stage_less_layers: int = 1
    """The first stage gets this many fewer blocks than the others, for its embedding."""
    pipeline_parallel_last_stage_less_layers: int = 1
    """The last stage gets this many fewer blocks than the others, for its norm and output layer."""


MUON_GROUPS = ("attention", "feed_forward", "experts")
"""The block matrices optimizer.muon_groups may name (titanlite.optim.muon.muon_group sorts them)."""


@dataclass(frozen=True)
class Optimizer:
    name: str = "AdamW"
    """AdamW, or Muon: Muon updates the 2-D matrices of the groups in muon_groups, AdamW (lr,
    betas, eps, weight_decay below) the rest (embeddings, output, norms, biases, router gates)."""
    lr: float = 8e-4
    """Peak learning rate (with Muon: of the AdamW group)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay (with Muon: of the AdamW group)."""
    muon_lr: float = -1.0
    """Muon's peak learning rate; -1 takes optimizer.lr (Muon's update is scaled to AdamW's RMS,
    0.2 x sqrt(max(rows, cols)), so AdamW's learning rate carries over at scale; narrow models
    need more: debug_model.toml and llama3_100m.toml set it, docs/optimizers.md)."""
    muon_weight_decay: float = -1.0
    """Muon's decoupled weight decay; -1 takes optimizer.weight_decay."""
    muon_momentum: float = 0.95
    """Muon's momentum (an exponential average of the gradients), in [0, 1)."""
    muon_nesterov: bool = True
    """Orthogonalise the Nesterov look-ahead of the momentum instead of the momentum itself."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations per orthogonalisation (coefficients 3.4445, -4.7750, 2.0315)."""
    muon_groups: list[str] = field(default_factory=lambda: ["attention", "feed_forward", "experts"])
    """Block matrices Muon updates: attention (projections), feed_forward (dense MLP, MoE
    shared experts), experts (each routed expert's matrices, one at a time); the rest go to AdamW."""
    implementation: str = "fused"
    """fused (one kernel per step for all parameters) or foreach (a few multi-tensor kernels
    per update term; each reads and writes the whole optimizer state again)."""


@dataclass(frozen=True)
class LRScheduler:
    warmup_steps: int = 10
    """Linear warm-up steps from near zero to the peak LR; a run of fewer steps (a smoke
    test) shortens it to training.steps - 1."""
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
    merge_last: int = 0
    """Checkpoint merging in the run: the fp32 average of the weights of the last N steps before each
    scheduled save (every interval, and the final step), written in that checkpoint as
    step-K/merged (a model-only checkpoint); the running sum, sharded like the weights, is saved in
    each checkpoint. At most checkpoint.interval; 0 = off. docs/recipes.md."""
    keep_latest_k: int = 0
    """Keep only the newest K complete checkpoints (K exactly, a resume's included); 0 keeps all."""
    load_step: int = -1
    """Resume from this step's checkpoint (refused if it fails to load); -1 means the newest
    complete one that loads, passing over (with a warning) any whose files fail to read."""
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
class FaultTolerance:
    max_restarts: int = 0
    """After a rank fails (a crash, a kill, a failed collective, a hang: exit 1 or 124; never a
    bad config), run_train.sh's torchrun restarts every rank up to this many times, and the run
    resumes from the newest checkpoint that loads (needs checkpoint.enable). Each restart is a
    line, a row of <dump_folder>/restarts.jsonl and the TensorBoard scalar train/restarts.
    With enable, a restarted group heals from a live peer instead (no checkpoint needed)."""
    enable: bool = False
    """Replica groups (torchft, `pip install 'titanlite[ft]'`): this launch is one group of
    group_size; the groups average gradients through torchft per step, each step's global
    batch split over the groups in that step's quorum. A group that fails drops out and the
    others go on; a restarted one heals from a live peer (docs/reliability.md)."""
    replica_id: int = 0
    """This group's number, 0 .. group_size - 1 (one ./run_train.sh per group)."""
    group_size: int = 1
    """The number of replica groups the job was started with."""
    min_replica_size: int = 1
    """A step commits only with at least this many groups in its quorum (else it is retried)."""
    lighthouse: str = ""
    """The torchft lighthouse's address (http://host:port); empty: the TORCHFT_LIGHTHOUSE
    environment variable."""
    timeout_s: float = 60.0
    """torchft's quorum and collective timeout: how long the groups wait for each other."""
    rerun_on_nonfinite: bool = False
    """With max_restarts (and run_train.sh's launcher): a step stopped as non-finite
    (training.on_nonfinite = stop) is rerun by the restarted attempt, from the newest checkpoint
    with the same weights and its data on other ranks (the data-parallel order shifted by one),
    each rank watching where a non-finite value first appears. Non-finite again on the same
    ranks: their machines'; on the ranks now holding the data: the data's or the model's; the
    run stops with one line and spends no more restarts. Finite: it was transient, a suspected
    hardware fault. Either fault is recorded with its ranks and hosts in
    <dump_folder>/restarts.jsonl. On a GPU it needs training.deterministic."""


@dataclass(frozen=True)
class Metrics:
    log_freq: int = 10
    """Log every N steps (and the first and last step)."""
    enable_tensorboard: bool = True
    """Write TensorBoard event files."""
    straggler_ratio: float = 0.0
    """> 0: on each logged step, gather every rank's own step time and log the slowest rank, its
    host and its ratio to the median (straggler_*; TensorBoard perf/straggler_ratio), with one
    warning once a rank is over this ratio for straggler_logs logs in a row. 0: no report."""
    straggler_logs: int = 3
    """Logged steps in a row a rank must be over straggler_ratio before the warning."""


@dataclass(frozen=True)
class ActivationCheckpoint:
    mode: str = "none"
    """none, full, or selective (see selective_type)."""
    selective_every: int = 2
    """With selective mode, checkpoint every N-th transformer block."""
    selective_type: str = "layer"
    """With selective mode: layer (every `selective_every`-th block recomputed whole) or op (every
    block keeps its matmul and attention outputs and recomputes the cheap ops between them)."""
    selective_op_matmuls: str = "all"
    """With selective op mode: keep every matmul's output (all), or every other one in each block
    (alternate: TorchTitan's policy, which recomputes the others in backward: less memory, about
    an eighth more FLOPs for Llama 3 8B)."""


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
class LoRA:
    """Low-rank adapters (docs/post_training.md): every weight of the model is frozen, and each
    target linear layer W gains a trained update scale * B A (A: rank x in, B: out x rank, B
    zero at first), scale = alpha / rank (alpha / sqrt(rank) with rslora)."""

    rank: int = 0
    """Rank of each adapter; > 0 turns LoRA on. 0: every weight trains (pre-training, full fine-tuning)."""
    alpha: float = 16.0
    """The adapters' scale numerator (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on each adapter's input, in training; in [0, 1). Its masks come from torch's
    generator, seeded alike on every rank: ranks holding different rows of a batch drop the same
    positions of them, so a run with dropout equals neither one process nor another layout."""
    rslora: bool = False
    """Rank-stabilised scaling, alpha / sqrt(rank) (PEFT's use_rslora)."""
    target_modules: list[str] = field(default_factory=lambda: ["wq", "wk", "wv", "wo"])
    """Linear layers that get an adapter, by titanlite name (attention.wq, feed_forward.w2, output)
    or by the family's Hugging Face name (q_proj, mlp.down_proj, lm_head); a name takes every
    linear whose full name is it or ends with it. Each must take at least one."""
    train_in_full: list[str] = field(default_factory=list)
    """Modules trained whole beside the adapters (PEFT's modules_to_save), by the same names: for
    example output (lm_head). The rest of the model stays frozen."""
    initial_adapter: str = ""
    """A PEFT adapter folder (adapter_config.json, adapter_model.safetensors) the adapters start
    from, instead of A drawn and B zero; its rank, alpha, rslora and targets must be these."""
    export_folder: str = "peft"
    """At the end of the run, the adapter is written there as a PEFT folder (under job.dump_folder
    when relative); empty: no export (python -m titanlite.tools.convert dcp peft does it from a checkpoint)."""


@dataclass(frozen=True)
class MoE:
    """Mixture-of-experts training knobs (model families whose blocks use titanlite.layers.moe)."""

    aux_loss_coeff: float = 0.0
    """Weight of the load-balancing auxiliary loss (Switch style; loads counted over each
    micro-batch on all data-parallel ranks); 0 = off."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): after each optimizer step every router's
    selection bias moves by this much towards the mean load; 0 = off."""
    grouped_mm: str = "auto"
    """Experts as one grouped GEMM (torch.nn.functional.grouped_mm): auto (where supported, else a loop
    over experts), on (grouped GEMM or an error), off (the loop)."""


@dataclass(frozen=True)
class Comm:
    """Time limits by phase (as TorchTitan's): each bounds the phase on a watchdog thread and,
    5 s later, every collective issued in it (the process groups' timeout follows the phase)."""

    init_timeout_s: int = 300
    """Seconds for set-up (process groups, model, first load) and the first step, which also
    compiles and warms up."""
    train_timeout_s: int = 100
    """Seconds the compute of any training step after the first may take (collectives
    included), and its logging; past it, every rank writes its stacks to <dump_folder>/hang/
    and exits non-zero. At most comm.init_timeout_s."""
    save_timeout_s: int = 600
    """Seconds a checkpoint save may take (the same hang report past it)."""
    validation_timeout_s: int = 600
    """Seconds one evaluation of the validation loss may take (the same hang report past it)."""
    eval_timeout_s: int = 1800
    """Seconds one in-loop evaluation ([eval]) may take (the same hang report past it): it scores
    eval.limit examples of every task, often many more sequences than a validation, and
    generation tasks decode token by token."""


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
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    metrics: Metrics = field(default_factory=Metrics)
    data: Data = field(default_factory=Data)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    comm: Comm = field(default_factory=Comm)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
    float8: Float8 = field(default_factory=Float8)
    moe: MoE = field(default_factory=MoE)
    lora: LoRA = field(default_factory=LoRA)
    preference: Preference = field(default_factory=Preference)
    eval: Eval = field(default_factory=Eval)
    rl: RL = field(default_factory=RL)


CHOICES: dict[str, tuple[str, ...]] = {
    "job.memory_check": ("error", "warn", "off"),
    "model.attn_backend": ("sdpa", "flex", "varlen"),
    "training.mixed_precision_param": ("auto", "float32", "bfloat16"),
    "training.mixed_precision_reduce": ("float32", "bfloat16"),
    "training.device": ("auto", "cpu", "cuda"),
    "training.on_nonfinite": ("stop", "skip"),
    "training.on_spike": ("off", "skip", "rollback"),
    "training.warmup_unit": ("steps", "tokens"),
    "parallelism.fsdp_reshard_after_forward": ("default", "always", "never"),
    "parallelism.pipeline_parallel_schedule": ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS",
                                               "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"),
    "optimizer.name": ("AdamW", "Muon"),
    "optimizer.implementation": ("fused", "foreach"),
    "optimizer.muon_groups": MUON_GROUPS,
    "lr_scheduler.decay_type": ("linear", "cosine"),
    "activation_checkpoint.mode": ("none", "full", "selective"),
    "activation_checkpoint.selective_type": ("layer", "op"),
    "activation_checkpoint.selective_op_matmuls": ("all", "alternate"),
    "compile.components": ("model", "loss"),
    "float8.recipe": ("tensorwise", "rowwise", "rowwise_with_gw_hp"),
    "moe.grouped_mm": ("auto", "on", "off"),
    "checkpoint.async_mode": ("disabled", "async"),
    "checkpoint.on_save_error": ("stop", "continue"),
    "checkpoint.initial_load_format": ("dcp", "hf"),
    "checkpoint.export_dtype": ("", "float32", "bfloat16", "float16"),
    "data.format": ("text", "chat", "preference"),
    "preference.loss": ("dpo", "ipo", "simpo", "dpo_norm"),
    "preference.reference": ("lora", "model", "precomputed"),
    "data.train_on": ("assistant", "all", "last"),
    "data.overlong": ("truncate", "drop"),
    "rl.loss_norm": LOSS_NORMS,
}
"""The allowed values of every key that takes one of a fixed set (each element, for a list):
declared here once; titanlite.config.load checks them, and the code that dispatches on a key
(titanlite.layers.attention.BACKENDS, titanlite.parallel.pipeline.SCHEDULES) reads them here."""
