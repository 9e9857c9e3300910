"""Convert model weights between formats, in one process.

    python -m titanlite.tools.convert dcp hf    CKPT_DIR  HF_DIR    [--dtype bfloat16] [--max-shard-gb 5]
    python -m titanlite.tools.convert hf  dcp   HF_DIR    CKPT_DIR  [--model llama3]
    python -m titanlite.tools.convert dcp torch CKPT_DIR  FILE.pt   [--dtype bfloat16]
    python -m titanlite.tools.convert dcp peft  CKPT_DIR  PEFT_DIR

dcp is a titanlite checkpoint folder (step-N, export-step-N or a converted one; only the
model is read). hf is a transformers folder (config.json + safetensors). torch is one
torch.save file of the model's state dict with titanlite names; read it with
torch.load(path, weights_only=True). A LoRA run's checkpoint holds its adapter: to hf and
torch it is merged into its base weights (the run's checkpoint.initial_load_path, or its seed),
W + scale B A in float32; to peft it is written as a PEFT adapter folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

import titanlite
from titanlite.checkpoint.dcp import load_initial, load_tensors, model_shapes, read_info, saved_args, write_model_checkpoint
from titanlite.checkpoint.peft import LoRAInfo, merge, to_peft, write_peft
from titanlite.errors import ConfigError
from titanlite.layers import init
from titanlite.checkpoint.hf import write_hf_folder
from titanlite.model_spec import ModelSpec, get_model_spec

FORMATS = ("dcp", "hf", "torch", "peft")


def _adapter(spec: ModelSpec):
    if spec.hf is None:
        raise ConfigError(f"model '{spec.name}' has no Hugging Face adapter (models/{spec.name}/hf.py)")
    return spec.hf


def base_weights(spec: ModelSpec, args: Any, base: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The weights a LoRA run trained on, loaded as its trainer loaded them: the run's model (its
    args) seeded, then its checkpoint.initial_load_path through the trainer's own initial load
    and checks (titanlite.checkpoint.dcp.load_initial; titanlite.checkpoint.lora.checkpointing
    records which). A weight a transformers folder lacks keeps the seeded value: the run's seed,
    so one that is not recorded is refused rather than guessed."""
    with torch.device("meta"):
        model = spec.build(args)
    init.materialize(model, torch.device("cpu"), base.get("seed", 0))
    if base["format"] != "seed":
        fresh = load_initial([model], Path(base["path"]), base["format"], spec, args)
        if fresh and "seed" not in base:
            raise ConfigError(f"{base['path']} holds no weights for {fresh[0]} (and {len(fresh) - 1} more), which the "
                              "LoRA run seeded with a seed its checkpoint does not record; convert its PEFT adapter "
                              "(dcp peft) and merge it onto the base with peft instead")
    return model.state_dict()


def _read_dcp(path: Path, merged: bool = True):
    """(spec, args, the model's state dict, the LoRA run's settings or None); a LoRA run's adapter
    `merged` into its base weights, else its trained tensors as saved."""
    info = read_info(path)
    spec = get_model_spec(info["model"])
    args = saved_args(list(spec.flavors.values()), info["args"])
    record = info.get("transform", {})
    if "lora" not in record:
        return spec, args, load_tensors(path, "model."), None
    lora, trained = LoRAInfo.of(record["lora"]), load_tensors(path, "model.")
    if not merged:
        return spec, args, trained, lora
    return spec, args, merge(base_weights(spec, args, record["base"]), trained, lora), lora


def convert(src: str, dst: str, src_format: str, dst_format: str, *, model: str = "llama3",
            dtype: str = "", max_shard_gb: float = 5.0) -> None:
    src_path, dst_path = Path(src), Path(dst)
    cast = (lambda sd: sd) if not dtype else (lambda sd: {k: v.to(getattr(torch, dtype)) for k, v in sd.items()})
    if (src_format, dst_format) == ("dcp", "peft"):
        spec, args, trained, lora = _read_dcp(src_path, merged=False)
        if lora is None:
            raise ConfigError(f"{src_path} is not a LoRA run's checkpoint (no adapter); convert it to hf")
        base = read_info(src_path)["transform"]["base"]["path"]
        write_peft(dst_path, *to_peft(trained, lora, _adapter(spec), args, model_shapes(spec, args), base))
    elif (src_format, dst_format) == ("dcp", "hf"):
        spec, args, sd, _ = _read_dcp(src_path)
        adapter = _adapter(spec)
        sd = cast(sd)
        out_dtype = next(iter(sd.values())).dtype
        write_hf_folder(dst_path, adapter.to_hf(sd, args), adapter.config_to_hf(args, out_dtype),
                        max_shard_bytes=int(max_shard_gb * 2**30))
    elif (src_format, dst_format) == ("hf", "dcp"):
        # load_hf checks the folder against what the family computes (its activation) and seeds,
        # saying so in one line, a weight group transformers never saves (DeepSeek-V3's MTP depth)
        net, args = titanlite.load_hf(src_path, model)
        write_model_checkpoint(dst_path, cast(net.state_dict()), model, args)
    elif (src_format, dst_format) == ("dcp", "torch"):
        _, _, sd, _ = _read_dcp(src_path)
        dst_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(cast(sd), dst_path)
    else:
        raise ConfigError(f"cannot convert {src_format} to {dst_format}; supported: dcp->hf, hf->dcp, dcp->torch, "
                          "dcp->peft")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m titanlite.tools.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src_format", choices=FORMATS)
    parser.add_argument("dst_format", choices=FORMATS)
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--model", default="llama3", help="model family when reading hf (default llama3)")
    parser.add_argument("--dtype", default="", choices=("", "float32", "bfloat16", "float16"),
                        help="cast the weights (default: keep)")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size for hf output")
    a = parser.parse_args(argv)
    try:
        if not Path(a.src).exists():
            raise ConfigError(f"{a.src} does not exist")
        convert(a.src, a.dst, a.src_format, a.dst_format, model=a.model, dtype=a.dtype,
                max_shard_gb=a.max_shard_gb)
    except ConfigError as e:
        sys.exit(f"titanlite: error: {e}")
    print(f"titanlite: wrote {a.dst} ({a.dst_format})")


if __name__ == "__main__":
    main()
