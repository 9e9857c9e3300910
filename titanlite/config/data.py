"""The data sections of the job config (data, validation) and their checks, which read no file.

Part of titanlite.config: a leaf (errors only), importable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from titanlite.errors import ConfigError


@dataclass(frozen=True)
class Data:
    path: str = ""
    """A .txt/.jsonl/.parquet file or a folder of them, a datasets folder, hf:NAME, or a token
    folder (python -m titanlite.tools.tokenize); empty means the embedded Python
    standard-library source."""
    text_field: str = "text"
    """Field holding the text in .jsonl records."""
    tokenizer: str = "byte"
    """byte (built in), byte_chat (the byte tokenizer's ids with a ChatML chat template, built in)
    or a folder with Hugging Face tokenizer files."""
    shuffle: bool = True
    """Shuffle samples with data.seed (layout-independent)."""
    seed: int = 0
    """Seed of the sample order."""
    num_workers: int = 0
    """Data loader worker processes."""
    holdout_fraction: float = 0.01
    """Tail fraction of the token stream (with format chat: of the chats) kept out of training for
    validation."""
    split: str = "train"
    """Split to read from a Hugging Face data set (hf:NAME or a save_to_disk folder)."""
    mix: list[str] = field(default_factory=list)
    """Weighted mixture instead of data.path: ["SOURCE:WEIGHT", ...] (on the command line
    SOURCE:WEIGHT,SOURCE:WEIGHT); weights are relative, honoured to 1/1000. Each SOURCE is
    anything data.path accepts."""
    skip_samples: str = ""
    """Global sample ranges never trained on, "START-END,..." (END excluded; every global batch
    that overlaps one is passed over), e.g. the data around a loss spike; a spike rollback
    records its own in the checkpoint. Not with data.streaming."""
    streaming: bool = False
    """Read data.path lazily (Hugging Face datasets streaming) instead of tokenizing it whole
    up front; see docs/data.md for what order guarantees hold."""
    shuffle_buffer: int = 10000
    """Documents in the shuffle buffer of a streamed source."""
    document_mask: bool = False
    """Attention stays within each document of a packed sample, and RoPE positions
    restart at each document (as if each ran alone)."""
    format: str = "text"
    """text (documents back to back, cut into samples) or chat: rows of OpenAI-style messages,
    each rendered whole with the tokenizer's chat template, several packed per sample (needs
    document_mask); the loss is on the tokens data.train_on names. An empty data.path is then the
    built-in chat set (standard-library docstrings). preference: rows of prompt, chosen and
    rejected messages (TRL's conversational form), trained with the [preference] loss; an empty
    data.path is the built-in preference set. docs/post_training.md."""
    messages_field: str = "messages"
    """With format chat: the field (.jsonl) or column (.parquet, data sets) holding each row's list
    of messages: {"role": system, user, assistant or tool, "content": ...}."""
    train_on: str = "assistant"
    """With format chat: the target tokens: assistant (every assistant turn, where the template's
    {% generation %} spans say, else by rendering each prefix), all (every token), last (the
    last assistant turn only)."""
    overlong: str = "truncate"
    """With format chat: a chat longer than training.seq_len + 1 tokens is truncate(d) to its first
    seq_len + 1 or drop(ped); the counts are logged (chats_truncated, chats_dropped)."""


@dataclass(frozen=True)
class Preference:
    """With data.format preference: the pair loss (titanlite.preference)."""

    loss: str = "dpo"
    """dpo (sigmoid), ipo (length-averaged log-ratios, TRL's), simpo (reference-free, length-averaged,
    margin gamma) or dpo_norm (DPO on length-averaged log-ratios, Tulu 3's)."""
    beta: float = 0.1
    """The reward scale (IPO's tau); > 0."""
    gamma: float = 0.5
    """SimPO's target margin (used by simpo only)."""
    sft_weight: float = 0.0
    """Weight of an SFT term: the mean negative log-prob of the chosen responses' target tokens over
    the step's global batch (TRL's loss_type sft with this loss weight)."""
    reference: str = "lora"
    """lora (the same model with its adapters off; needs [lora]), model (a frozen copy of the
    starting weights, sharded as the policy) or precomputed (the reference's log-prob sums of every
    pair, two floats each, computed before the first step and saved with each checkpoint; LoRA or
    full fine-tuning, no reference forward in the steps)."""


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



def parse_ranges(text: str) -> tuple[tuple[int, int], ...]:
    """data.skip_samples "START-END,..." -> ((start, end), ...), END excluded."""
    ranges = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        start, _, end = item.partition("-")
        if not (start.isdigit() and end.isdigit() and int(start) < int(end)):
            raise ConfigError(f"data.skip_samples: bad range '{item}'; expected START-END with START < END, "
                              "e.g. 1024-2048")
        ranges.append((int(start), int(end)))
    return tuple(ranges)


def check_source(path: str, key: str = "data.path") -> None:
    """Cheap existence check for config validation (no files are read)."""
    if path and not path.startswith("hf:") and not Path(path).exists():
        raise ConfigError(f"{key}: '{path}' does not exist")


def parse_mix(spec: list[str]) -> list[tuple[str, float]]:
    """["SOURCE:WEIGHT", ...] -> [(source, weight)]; the weight follows the last colon."""
    out = []
    for entry in spec:
        source, colon, weight = entry.strip().rpartition(":")
        try:
            w = float(weight) if colon else float("nan")
        except ValueError:
            w = float("nan")
        if not w > 0 or w == float("inf"):
            raise ConfigError(f"data.mix: entry '{entry.strip()}' must be SOURCE:WEIGHT with a "
                              "weight > 0, e.g. data.mix = [\"a.jsonl:0.7\", \"b_folder:0.3\"]")
        if source in (s for s, _ in out):
            raise ConfigError(f"data.mix: source '{source}' appears twice; add its weights up")
        out.append((source, w))
    if len(out) < 2:
        raise ConfigError("data.mix needs at least two SOURCE:WEIGHT entries; use data.path for one")
    return out


def check_data(d: Data, v: Validation) -> None:
    """The data and validation sections' checks that read no file (a path's existence only)."""
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
    if d.format in ("chat", "preference"):
        _check_chat(d)
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


def _check_chat(d: Data) -> None:
    """data.format chat or preference: what it cannot run with, before any file is read."""
    if d.streaming:
        raise ConfigError(f"data.format {d.format} reads its rows whole to pack them; set data.streaming = false")
    if not d.document_mask:
        raise ConfigError(f"data.format {d.format} packs several chats per sample; set data.document_mask = true "
                          "so that each chat attends only to itself, with its own positions")
    if d.tokenizer == "byte":
        raise ConfigError(f"data.format {d.format} renders each chat with the tokenizer's chat template, and "
                          "data.tokenizer 'byte' has none; use 'byte_chat' (the same ids, with a template) or a "
                          "tokenizer folder whose tokenizer_config.json has a chat_template")
    if not d.messages_field:
        raise ConfigError("data.messages_field is empty; name the field that holds each row's messages")


def check_preference(p: Preference, d: Data, lora: bool, z_loss: float = 0.0,
                     seq_warmup: bool = False, pp_schedule: str = "") -> None:
    """The [preference] section's values and what it needs of the rest, before any file is read."""
    if d.format != "preference":
        return
    if z_loss:
        raise ConfigError("training.z_loss is a token loss's term, and data.format preference trains a pair loss; "
                          "set training.z_loss = 0")
    if seq_warmup:
        raise ConfigError("training.seq_warmup cuts samples into shorter rows, which would split preference "
                          "pairs; leave training.seq_warmup out with data.format preference")
    if not p.beta > 0:
        raise ConfigError(f"preference.beta must be > 0, got {p.beta}")
    if p.sft_weight < 0:
        raise ConfigError(f"preference.sft_weight must be >= 0, got {p.sft_weight}")
    if p.loss == "simpo":
        return  # reference-free: preference.reference is not read
    if pp_schedule in ("ZBVZeroBubble", "DualPipeV"):
        # the reference pass of step 1 comes before any training run of the schedule, and only the
        # schedule's own forward-only run (eval) can set its stages up, which V schedules cannot run
        raise ConfigError(f"parallelism.pipeline_parallel_schedule {pp_schedule} cannot run the reference pass of "
                          f"preference.loss {p.loss} before its first step (torch runs a V schedule's backward "
                          "actions in its forward-only run); use 1F1B, GPipe, Interleaved1F1B or another "
                          "schedule without a V")
    if p.reference == "model" and lora:
        raise ConfigError("preference.reference = model with LoRA would copy the model needlessly: the LoRA "
                          "model with its adapters off is the reference; set preference.reference = lora")
    if p.reference == "lora" and not lora:
        raise ConfigError("preference.reference = lora needs LoRA (lora.rank > 0); for full fine-tuning set "
                          "preference.reference = model")
