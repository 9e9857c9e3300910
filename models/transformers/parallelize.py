"""How a transformers architecture is parallelized: its tensor-parallel plan translated from the
architecture's own `base_model_tp_plan`, and the layouts refused before launch (a plan style
titanlite does not apply, expert parallelism, a pipeline cut its forward does not allow).

Translation, block entries (`layers.*.<path>`):
    colwise                         -> ColwiseParallel (this rank's heads / hidden units)
    rowwise                         -> RowwiseParallel, output in the residual stream's layout
    colwise_gather_output           -> ColwiseParallel with its output gathered whole
    rowwise_split_input             -> RowwiseParallel taking a whole input, each rank its slice
    replicated_with_grad_allreduce  -> whole on each rank's heads, gradient summed (QK-norm)
Each sub-layer holding entries (self_attn, mlp) gathers the residual stream first; a module
with parameters inside one that has no entry runs whole where every split output was gathered
(OLMo 2's QK-norm over all heads), and is refused where it would see one rank's heads. The
block's other modules with parameters (its norms) are on the residual stream: sequence
parallel, or whole on every rank. The embedding and lm_head split the vocabulary (lm_head's
logits stay split for a loss-parallel cross-entropy).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from titanlite.errors import ConfigError
from titanlite.model_spec import Elsewhere
from titanlite.parallel.tensor import NormParallel, TokenParallel, TPPlan, run_whole

from .model import ModelArgs, build, hf_config

STYLES = {
    "colwise": lambda between: ColwiseParallel(),
    "rowwise": lambda between: RowwiseParallel(output_layouts=between),
    "colwise_gather_output": lambda between: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda between: RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
    "replicated_with_grad_allreduce": lambda between: TokenParallel(),
}
"""transformers' TP plan styles titanlite applies, by name (between: the residual stream's layout)."""
GATHERED = ("colwise_gather_output",)
TP = "parallelism.tensor_parallel_degree > 1"
IN_PLACE = {"clip_qkv": "self_attn"}
"""Config keys under which the architecture's forward changes the named sub-layer's projection
outputs in place (OLMo's and OLMoE's clip_qkv: `query_states.clamp_(...)`), when set."""


class WholeParallel(ParallelStyle):
    """The module whole on every rank, on whole (replicated) inputs; its parameters Replicate."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return run_whole(module, mesh, Replicate())


class OwnOutput(ParallelStyle):
    """`style`, its local output a copy: a colwise output is a view DTensor.to_local made inside
    an autograd Function, which autograd forbids changing in place (OLMo's clip_qkv clamp_)."""

    def __init__(self, style: ParallelStyle):
        super().__init__()
        self.style = style

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        module = self.style._apply(module, mesh)
        module.register_forward_hook(lambda mod, args, out: out.clone())
        return module


class HiddenStatesIn(ParallelStyle):
    """A sub-layer's hidden states (its first positional input, or `hidden_states=`), in the
    residual stream's layout `between`, gathered whole before it runs. Kept a DTensor, so its
    projections' input gradients are summed first and leave as one reduce(-scatter)."""

    def __init__(self, between: Placement):
        super().__init__()
        self.between = between

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def gather(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (self._whole(args[0], mesh), *args[1:]), kwargs
            if "hidden_states" not in kwargs:
                raise RuntimeError(f"{type(mod).__name__} was called without hidden states (first argument or "
                                   "hidden_states=); tensor parallel cannot gather its input")
            return args, {**kwargs, "hidden_states": self._whole(kwargs["hidden_states"], mesh)}

        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module

    def _whole(self, x, mesh: DeviceMesh) -> DTensor:
        x = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [self.between], run_check=False)
        return x.redistribute(mesh, [Replicate()])


def translate(config, between: Placement, key: str = TP) -> tuple[dict[str, str], dict[str, ParallelStyle]]:
    """The architecture's base_model_tp_plan block entries (within one block) and their styles;
    an entry titanlite cannot apply is refused in one line naming it (`key`: the layout's)."""
    names, block = {}, {}
    plan = getattr(config, "base_model_tp_plan", None) or {}
    if not plan:
        raise ConfigError(f"{key}: {type(config).__name__} declares no base_model_tp_plan; train it with "
                          "tensor_parallel_degree 1")
    for entry, style in plan.items():
        if entry == "embed_tokens" and style.startswith("embedding_rowwise"):
            continue  # titanlite splits the embedding on the vocabulary itself
        path = entry.removeprefix("layers.*.")
        if path == entry or style not in STYLES:
            raise ConfigError(f"{key}: {type(config).__name__}.base_model_tp_plan entry '{entry}': '{style}' is not "
                              f"a style titanlite applies ({', '.join(STYLES)}); train it with "
                              "tensor_parallel_degree 1")
        names[path] = style
        block[path] = STYLES[style](between)
        if style == "colwise" and any(path.startswith(sub + ".") for key, sub in IN_PLACE.items()
                                      if getattr(config, key, None) is not None):
            block[path] = OwnOutput(block[path])
    return names, block


def block_plan(block: nn.Module, config, between: Placement, key: str = TP) -> dict[str, ParallelStyle]:
    """Every entry one block needs: the translated plan, its sub-layers' inputs, the modules with
    parameters the plan leaves out (inside a sub-layer or on the residual stream)."""
    names, plan = translate(config, between, key)
    subs = {p.split(".")[0] for p in names}
    plan |= {s: HiddenStatesIn(between) for s in subs}
    # NormParallel: torch's SequenceParallel keeping each weight's requires_grad (a norm frozen under LoRA stays so)
    stream = NormParallel(use_local_output=True) if isinstance(between, Shard) else WholeParallel()
    for path, module in block.named_modules():
        covered = any(path == n or path.startswith(n + ".") or n.startswith(path + ".") for n in names)
        if not path or covered or not any(True for _ in module.parameters(recurse=False)):
            continue  # the block's own parameters are check_tp_covered's to refuse
        sub = path.split(".")[0]
        if sub not in subs:
            if "norm" not in type(module).__name__.lower():
                # a sub-layer no entry splits (Hunyuan's plan has the embedding alone) would run on the
                # residual stream's sequence shard: its attention would see this rank's tokens only
                raise ConfigError(f"{key}: {type(config).__name__}'s layers.*.{path} ({type(module).__name__}) is in "
                                  "no base_model_tp_plan entry and is no norm on the residual stream; train it with "
                                  "tensor_parallel_degree 1")
            plan[path] = stream
            continue
        split = [s for n, s in names.items() if n.startswith(sub + ".") and s.startswith("colwise")]
        if any(s not in GATHERED for s in split):
            raise ConfigError(f"{key}: {type(config).__name__}'s layers.*.{path} "
                              "is in no base_model_tp_plan entry but sees one rank's share of "
                              f"{sub}; train it with tensor_parallel_degree 1")
        plan[path] = WholeParallel()
    return plan


def tp_plan(between: Placement, loss_parallel: bool, model: nn.Module) -> TPPlan:
    """The plan of `model` (a whole model or a pipeline stage), read off its architecture."""
    blocks = list(model.get_submodule("model.layers").children())
    root = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        # with loss parallel the logits stay a DTensor sharded on vocab for the loss
        "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=not loss_parallel),
    }
    return TPPlan(root, block_plan(blocks[0], model.config, between), root_norms=("model.norm",))


def check_layout(args: ModelArgs, dims) -> None:
    """ModelSpec.check_layout: refuse, before launch, a tensor-parallel plan titanlite cannot
    apply, expert parallelism (transformers' experts are not titanlite's MoE layers), and a
    pipeline cut the architecture's forward does not allow."""
    config = hf_config(args)
    if dims.ep > 1:
        raise ConfigError(f"parallelism.expert_parallel_degree {dims.ep}: expert parallelism shards titanlite's MoE "
                          f"layers; {type(config).__name__}'s experts are transformers' own: train it with FSDP "
                          "(expert_parallel_degree 1)")
    if dims.pp > 1 and getattr(config, "output_router_logits", False):
        # its loads are summed over every layer before the product: one stage's need the later stages'
        raise ConfigError(f"parallelism.pipeline_parallel_degree {dims.pp}: {type(config).__name__}'s load-balancing "
                          "loss (output_router_logits) couples the routing of every layer, which pipeline stages "
                          "hold apart; train it without pipeline parallelism, or set model.hf_overrides "
                          "output_router_logits=false")
    if dims.tp > 1 or dims.pp > 1:
        with torch.device("meta"):
            model = build(dataclasses.replace(args, n_layers=min(args.n_layers, 2)))
        if dims.tp > 1:
            block_plan(model.model.layers[0], config, Shard(1), f"parallelism.tensor_parallel_degree {dims.tp}")
        if dims.pp > 1:
            check_pipeline(model, f"parallelism.pipeline_parallel_degree {dims.pp}")


def check_pipeline(model: nn.Module, key: str) -> None:
    """A pipeline stage hands its hidden states on and the next one takes them as its input
    (transformers' inputs_embeds): that is the whole model's computation only if the base
    model's forward passes the embedding's output to the first block, each block's to the next
    and the last one's to the final norm unchanged. Run on meta, watched by hooks, with the
    blocks standing in as pipeline stages hold the others' (Elsewhere: its input passed on)."""
    plan = getattr(model.config, "base_model_pp_plan", None) or {}
    name = type(model).__name__.removeprefix("Titanlite")
    if set(plan) != {"embed_tokens", "layers", "norm"}:
        raise ConfigError(f"{key}: {type(model.config).__name__} declares no base_model_pp_plan of embed_tokens, "
                          "layers and norm; train it without pipeline parallelism")
    seen: list[tuple[str, object, object]] = []
    for i in range(len(model.model.layers)):
        model.model.layers[i] = Elsewhere()
    modules = [("embedding", model.model.embed_tokens), *((f"block {i}", b) for i, b in enumerate(model.model.layers)),
               ("final norm", model.model.norm)]
    handles = [m.register_forward_pre_hook(lambda mod, a, kw, n=n: seen.append((n, "in", (a or [*kw.values()])[0])),
                                           with_kwargs=True) for n, m in modules[1:]]
    handles += [m.register_forward_hook(lambda mod, a, out, n=n: seen.append((n, "out", out))) for n, m in modules[:-1]]
    try:
        with torch.no_grad():
            model(torch.zeros(1, 8, dtype=torch.long, device="meta"))
    finally:
        for h in handles:
            h.remove()
    for (before, _, out), (after, _, inp) in zip(seen[::2], seen[1::2]):
        if out is not inp:
            raise ConfigError(f"{key}: {name}'s forward changes the hidden states between its {before} and its "
                              f"{after} (a pipeline stage would not), so its stages would not compute the whole "
                              "model; train it without pipeline parallelism")
