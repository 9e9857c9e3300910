"""Validation: the mean token loss over the same `validation.steps` global batches every time.

Each rank sums the token losses and target counts of its micro-batches; one all-reduce over
the loss mesh (dp x cp) gives sum / count over the whole validation set, so the value does
not depend on the parallel layout or on how a global batch is split into micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from titanlite.config.data import Data, Validation
from titanlite.errors import ConfigError
from titanlite.data.loader import build_dataloader
from titanlite.data.pairs import target_count
from titanlite.config.data import parse_mix
from titanlite.data.sources import check_text, source_bytes
from titanlite.data.chat import check_template
from titanlite.data.tokenizer import Tokenizer


def validation_data(val: Validation, data: Data) -> tuple[Data, str]:
    """The data config and holdout split the validation loader reads, in a fixed order."""
    if val.path:
        return replace(data, path=val.path, split=val.split, mix=[], holdout_fraction=0.0,
                       shuffle=False, num_workers=0), "train"
    return replace(data, shuffle=False, num_workers=0), "val"


PREFLIGHT_READ_BYTES = 64 * 2**20
"""Data up to this size is tokenized by the pre-launch check, to count its samples; more would
make the check slow, and the ranks read it again anyway."""


def preflight_data(data: Data, val: Validation, tokenizer: Tokenizer, seq_len: int, global_batch_size: int,
                   local_batch_size: int, dp_degree: int) -> None:
    """Before launch, what the ranks' loaders would refuse: a source without text, a training
    split smaller than one global batch, a validation split smaller than validation.steps of them.
    Larger or remote sources are only checked for text."""
    sources = [("data.mix" if data.mix else "data.path", p) for p in ([data.path] if not data.mix
                                                                      else [p for p, _ in parse_mix(data.mix)])]
    if val.freq and val.path:
        sources.append(("validation.path", val.path))
    if data.format in ("chat", "preference"):  # every row is checked as it is rendered, below or on the ranks
        check_template(tokenizer, data.tokenizer)
    for key, path in sources if data.format == "text" else []:
        check_text(path, data.text_field, key)
    if data.streaming or sum(source_bytes(p) for _, p in sources) > PREFLIGHT_READ_BYTES:
        return
    # the loaders rank 0 builds, which run every size check (nothing is read past tokenization)
    build_dataloader(data, tokenizer, seq_len=seq_len, global_batch_size=global_batch_size,
                     local_batch_size=local_batch_size, dp_rank=0, dp_degree=dp_degree)
    Validator(val, data, tokenizer, seq_len, global_batch_size, local_batch_size, 0, dp_degree, None)


@dataclass
class Validator:
    val: Validation
    data: Data
    tokenizer: Tokenizer
    seq_len: int
    global_batch_size: int
    local_batch_size: int
    dp_rank: int
    dp_degree: int
    group: dist.ProcessGroup | None
    target_group: dist.ProcessGroup | None = None
    """Where target counts add up, if not `group`: under pipelining the loss sums come from the
    last stage's ranks but every stage counts the same targets."""

    def __post_init__(self) -> None:
        # Built up front so a bad validation source fails before training starts
        self.loader = None
        if self.val.freq > 0:
            cfg, split = validation_data(self.val, self.data)
            self.loader = build_dataloader(cfg, self.tokenizer, seq_len=self.seq_len,
                                           global_batch_size=self.global_batch_size,
                                           local_batch_size=self.local_batch_size,
                                           dp_rank=self.dp_rank, dp_degree=self.dp_degree, split=split)
            self.start = self.loader.state_dict()
            n = getattr(self.loader.dataset, "num_samples", None)  # streams and mixtures: unknown
            if n is not None and self.val.steps * self.global_batch_size > n:
                raise ConfigError(f"validation.steps {self.val.steps} x global batch {self.global_batch_size} "
                                  f"is more than the {n} validation samples; lower validation.steps "
                                  "(each evaluation reads every sample at most once)")

    def due(self, step: int, last_step: int) -> bool:
        return self.val.freq > 0 and (step % self.val.freq == 0 or step == last_step)

    def __call__(self, parts: list[nn.Module], prepare: Callable[[dict], dict],
                 loss_sum: Callable[[dict], torch.Tensor], device: torch.device) -> float:
        """Mean validation loss. `prepare` turns a loader micro-batch into this rank's part of it
        (as in training, so targets are counted once over dp x cp); `loss_sum` is the
        step's summed token loss of a prepared micro-batch (forward only)."""
        self.loader.load_state_dict(self.start)  # the same batches every time
        accum = self.global_batch_size // (self.local_batch_size * self.dp_degree)
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, target count
        for part in parts:
            part.eval()
        with torch.no_grad():
            for raw, _ in zip(self.loader, range(self.val.steps * accum)):
                batch = prepare(raw)
                totals[0] += loss_sum(batch).double()
                totals[1] += target_count(batch["labels"])
        for part in parts:
            part.train()
        if self.target_group is None:
            dist.all_reduce(totals, group=self.group)
        else:
            dist.all_reduce(totals[:1], group=self.group)
            dist.all_reduce(totals[1:], group=self.target_group)
        return (totals[0] / totals[1]).item()
