"""The seam between the framework and a model family folder under models/.

The folder is importable as `titanlite.models.<name>` (titanlite/models links to the repo's
models/ and is installed with the package), so copying a folder registers a new family.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
import site
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from collections.abc import Sequence

import torch.nn as nn

import titanlite.models
from titanlite.errors import ConfigError, WorkerError


def _no_layout_checks(args: Any, dims: Any) -> None:
    return None


def _no_notes(args: Any) -> tuple[str, ...]:
    return ()


def _no_hooks(parts: list[nn.Module], meshes: Any) -> list[Callable[[Any], Any]]:
    return []


@dataclass(frozen=True)
class ModelSpec:
    name: str
    flavors: dict[str, Any]
    """Flavor name -> the family's ModelArgs dataclass; its `n_layers` field is the number of
    blocks (pipeline shapes and the dry run build shallower copies through it)."""
    build: Callable[[Any], nn.Module]
    """ModelArgs -> single-device model, built on whatever device is current, its buffers (RoPE
    tables) computed. The trainer builds on meta; titanlite.layers.init.materialize then calls the
    model's `init_buffers()` and `init_weights(seed)` (parameters only) after `to_empty`. Its
    forward(tokens, ctx) returns logits; it must also run when the `pre` modules are
    nn.Identity (it then receives hidden states) and when the `post` ones are (it then
    returns hidden states): that is how pipeline stages are cut."""
    tp_plan: Callable[[Any, bool, nn.Module], Any]
    """(between, loss_parallel, model) -> titanlite.parallel.tensor.TPPlan: the family's
    tensor-parallel plan, `between` the residual stream's layout between blocks; `model` is
    the model (or pipeline stage) it is applied to, for a family whose plan its architecture
    declares (transformers' base_model_tp_plan)."""
    flops_per_token: Callable[[Any, int], float]
    """(ModelArgs, seq_len) -> training FLOPs per token (forward + backward), activated
    parameters only."""
    check_layout: Callable[[Any, Any], None] = _no_layout_checks
    """(ModelArgs, ParallelDims) -> raise ConfigError if the layout cannot serve the model, beyond
    what titanlite checks for every family (tensor-parallel heads and widths, every parameter
    covered by the plans: titanlite.parallel.tensor)."""
    hf: Any = None
    """titanlite.checkpoint.hf.HFAdapter mapping weights and config to transformers, if the family has one."""
    from_hf_config: Callable[[str, tuple[str, ...]], Any] | None = None
    """(model.hf_config, model.hf_overrides) -> ModelArgs, for a family whose architecture the
    config names rather than a flavor (models/transformers); None: flavors only."""
    compare_saved: Callable[[dict[str, Any], Any], list[tuple[str, Any, Any]]] | None = None
    """(a checkpoint's args as titanlite.json records them, this run's args) -> (the key to set,
    saved value, this run's) for each difference in what the model computes beyond the IDENTITY
    args (titanlite.checkpoint.dcp), which resume refuses; None: IDENTITY and shapes say it all."""
    notes: Callable[[Any], tuple[str, ...]] = _no_notes
    """ModelArgs -> lines the run prints at its start about how it trains the model (a setting of
    the model's own config that the run does not train with)."""
    blocks: str = "layers"
    """Path (dotted) of the module holding the transformer blocks, whose children are the
    blocks "0".."n-1" in the order they run: an nn.ModuleDict (a pipeline stage deletes the
    blocks it does not hold), or an nn.ModuleList (a stage puts `Elsewhere` in their place)."""
    pre: tuple[str, ...] = ("tok_embeddings",)
    """Modules (dotted paths) that run before the blocks (kept by the first pipeline stage only)."""
    post: tuple[str, ...] = ("norm", "output")
    """Modules (dotted paths) that run after the blocks (kept by the last pipeline stage only)."""
    post_step_hooks: Callable[[list[nn.Module], Any], list[Callable[[Any], Any]]] = _no_hooks
    """(model parts, titanlite.parallel.mesh.Meshes) -> callables run after every optimizer step
    (e.g. a router-bias update) with the step's device flag `skipped` (1.0 when its update was
    skipped as non-finite; the host may not have read it yet, so a hook that changes state masks
    its change with it on the device); each may return {name: scalar tensor} to log on logged steps."""
    extra_losses: tuple[str, ...] = ()
    """Names of the extra loss terms the model adds with titanlite.loss.add_extra_loss; each is
    logged like the loss (its global sum over the global target count)."""
    tp_replicated_losses: tuple[str, ...] = ()
    """Those extra losses each tensor-parallel rank computes whole, as the token loss (multi-token
    prediction on loss-parallel logits): logged once, like it; the others are sums over the
    tokens each rank routed."""

    def blocks_of(self, model: nn.Module) -> dict[str, nn.Module]:
        """The model's (or stage's) blocks by name ("0".."n-1", a stage's own range), in order."""
        return {k: b for k, b in model.get_submodule(self.blocks).named_children() if not isinstance(b, Elsewhere)}


class Elsewhere(nn.Module):
    """In a pipeline stage's nn.ModuleList of blocks, a block another stage holds: it passes its
    input on, so the list keeps its length and the model's forward its indices (transformers
    picks each layer's RoPE and mask by its position in the list)."""

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(titanlite.models.__path__) if m.ispkg)


def get_model_spec(name: str) -> ModelSpec:
    """Import titanlite.models.<name> and return its SPEC, whose `name` must be the folder's:
    checkpoints record it (and refuse another family's), and tools/convert picks the family by it."""
    if name not in available():
        raise ConfigError(f"model.name: unknown model '{name}'; available: {', '.join(available())}")
    spec = importlib.import_module(f"titanlite.models.{name}").SPEC
    if spec.name != name:
        raise ConfigError(f"models/{name}/__init__.py: SPEC.name is '{spec.name}' but its folder is '{name}'; "
                          f"set ModelSpec(name=\"{name}\", ...) (checkpoints record the family by it)")
    return spec


def in_model_code(exc: BaseException) -> str | None:
    """The one-line report of an exception a model family's own code raised: "models/<name>/<file>
    line N (in F): Type: message" at the innermost frame in a family folder, or None when no
    family's code is on its traceback (then it is titanlite's, or torch's)."""
    roots = [Path(folder).resolve() for folder in titanlite.models.__path__]
    frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(exc.__traceback__)]
    kind, message = type(exc).__name__, (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, WorkerError):  # raised in a worker process (a rank the dry run traces): its frames as text
        frames += [(f, int(n), fn) for f, n, fn in re.findall(r'File "(.+)", line (\d+), in (\S+)', exc.tb)]
        kind, message = exc.kind, exc.message
    if isinstance(exc, SyntaxError) and exc.filename:  # the file never ran: no frame of its own
        frames.append((exc.filename, exc.lineno, "<module>"))
    for i in reversed(range(len(frames))):
        filename, line, function = frames[i]
        path = Path(filename).resolve()
        for root in (r for r in roots if path.is_relative_to(r)):
            called = _called_package(frames[i + 1:])
            if called is not None:  # the family runs another package's modeling code (transformers'): it failed there
                return f"{called[0]} line {called[1]} (in {called[2]}): {kind}: {message}"
            return f"models/{path.relative_to(root)} line {line} (in {function}): {kind}: {message}"
    return None


def _called_package(frames: list[tuple[str, int, str]]) -> tuple[str, int, str] | None:
    """The innermost of `frames` (those below a family's own) in an installed package other than
    torch and titanlite (what the model's code computes with, not its code): ("pkg/file.py",
    line, function)."""
    sites = [Path(p).resolve() for p in site.getsitepackages()]
    for filename, line, function in reversed(frames):
        path = Path(filename).resolve()
        for root in (r for r in sites if path.is_relative_to(r)):
            relative = path.relative_to(root)
            if relative.parts[0] not in ("torch", "titanlite"):
                return str(relative), line, function
    return None


def model_args(spec: ModelSpec, flavor: str, vocab_size: int, seq_len: int, moe: Any = None, hf_config: str = "",
               hf_overrides: Sequence[str] = ()) -> Any:
    """The flavor's args (or, with `hf_config`, those the family reads from it:
    ModelSpec.from_hf_config) with config overrides applied and checked (`moe`: the [moe]
    section, for families whose args carry titanlite.layers.moe.MoEArgs as `moe`)."""
    if hf_config or hf_overrides:
        if spec.from_hf_config is None:
            raise ConfigError(f"model.hf_config: {spec.name} takes its architecture from model.flavor; a transformers "
                              "config trains with model.name = transformers")
        if not hf_config:
            raise ConfigError("model.hf_overrides change model.hf_config's config; set model.hf_config too")
        args, flavor = spec.from_hf_config(hf_config, tuple(hf_overrides)), hf_config
    elif flavor not in spec.flavors:
        raise ConfigError(f"model.flavor: unknown flavor '{flavor}' for '{spec.name}'; "
                          f"available: {', '.join(spec.flavors)}")
    else:
        args = spec.flavors[flavor]
    if seq_len > args.max_seq_len and (hf_config or hf_overrides):
        raise ConfigError(f"training.seq_len {seq_len} exceeds {flavor}'s max_position_embeddings "
                          f"{args.max_seq_len}; train on shorter sequences, or set model.hf_overrides "
                          f"max_position_embeddings={seq_len} if the model's positions allow it")
    if seq_len > args.max_seq_len:
        raise ConfigError(f"training.seq_len {seq_len} exceeds {spec.name} {flavor}'s "
                          f"max_seq_len {args.max_seq_len}")
    # the RoPE table only needs to cover the training sequence; an export keeps the model's own
    updates = {"max_seq_len": seq_len, "context_len": args.context_len or args.max_seq_len}
    if vocab_size:
        updates["vocab_size"] = vocab_size
    if moe is not None and getattr(args, "moe", None) is not None:  # a family may have dense flavors (None)
        updates["moe"] = dataclasses.replace(args.moe, aux_loss_coeff=moe.aux_loss_coeff,
                                             bias_update_rate=moe.bias_update_rate, grouped_mm=moe.grouped_mm)
    elif moe is not None and moe != type(moe)() and spec.from_hf_config is not None:
        raise ConfigError("the [moe] keys set titanlite's MoE layers; a transformers model's experts and their "
                          "load-balancing loss are its config's: leave the [moe] keys at their defaults and set "
                          "model.hf_overrides output_router_logits=true,router_aux_loss_coef=COEF")
    elif moe is not None and moe != type(moe)():
        raise ConfigError(f"the [moe] keys apply to mixture-of-experts models; {spec.name} {flavor} has no experts")
    return dataclasses.replace(args, **updates)
