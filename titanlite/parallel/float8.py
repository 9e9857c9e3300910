"""Float8 training of the Linear layers inside transformer blocks, through torchao.

Only H100/H200-class GPUs (compute capability >= 8.9) have float8 matmuls. Everything is
checked in preflight so an unsupported build or machine fails with one line before launch.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.nn as nn

from titanlite.config.job import Float8
from titanlite.errors import ConfigError


def preflight(cfg: Float8, device: str, tp: int, here: bool = True) -> None:
    """Refuse float8 where it cannot run: no torchao, no CUDA, a pre-Hopper GPU, or TP. `here`
    False: a plan for a CUDA job elsewhere (the dry run), so this machine's GPU is not asked."""
    if not cfg.enable:
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("float8.enable: torchao is not installed; `pip install 'titanlite[float8]'` "
                          "or set --float8.enable false")
    if tp > 1:
        raise ConfigError("float8.enable: float8 with tensor parallelism is not supported yet; "
                          "set parallelism.tensor_parallel_degree 1 or --float8.enable false")
    if device == "cuda" and not here:
        return
    if device == "cpu" or not torch.cuda.is_available():
        raise ConfigError("float8.enable: float8 training needs a CUDA GPU (H100/H200 class); "
                          "set --float8.enable false on this machine")
    if torch.cuda.get_device_capability() < (8, 9):
        raise ConfigError(f"float8.enable: {torch.cuda.get_device_name()} has no float8 matmuls "
                          "(needs compute capability >= 8.9, e.g. H100); set --float8.enable false")


def _fits(module: nn.Module, fqn: str) -> bool:
    # float8 matmuls need both Linear dims divisible by 16. A MoE router's gate stays in high
    # precision (as TorchTitan keeps it): its scores pick the experts, and a float8 rounding
    # flips the top-k of near-tied tokens.
    return (isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
            and not fqn.endswith("router.gate"))


def apply_float8(blocks: list[nn.Module], cfg: Float8, fsdp: bool) -> None:
    """Swap each block's nn.Linear for torchao's Float8Linear, router gates apart; embeddings and
    output stay as they are."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if cfg.recipe == "tensorwise":
        f8 = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp and cfg.enable_fsdp_float8_all_gather)
    else:
        f8 = Float8LinearConfig.from_recipe_name(cfg.recipe)
    for block in blocks:  # swaps the block's linears in place
        convert_to_float8_training(block, config=f8, module_filter_fn=_fits)


def post_step_hooks(cfg: Float8, fsdp: bool, parts: list[nn.Module]) -> list[Callable[[torch.Tensor], None]]:
    """With FSDP's float8 all-gather: after each optimizer step, one all-reduce for every float8
    weight scale of a part, instead of one per weight in the next forward. A skipped step left
    the weights as they were, so their scales are recomputed to the values already in use: the
    hook needs no skip flag (which the host may not have read yet)."""
    if not (cfg.enable and fsdp and cfg.recipe == "tensorwise" and cfg.enable_fsdp_float8_all_gather):
        return []
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return [lambda skipped, part=part: precompute_float8_dynamic_scale_for_fsdp(part) for part in parts]
