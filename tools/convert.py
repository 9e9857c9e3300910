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
W + scale B A in float32 (an adapter on a tied output layer unties it: written with its own
lm_head.weight); to peft it is written as a PEFT adapter folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

import titanlite
from titanlite.checkpoint.dcp import model_shapes
from titanlite.checkpoint.folder import read_info, write_model_checkpoint
from titanlite.checkpoint.peft import to_peft, write_peft
from titanlite.errors import ConfigError
from titanlite.checkpoint.hf import write_hf_folder
from titanlite.checkpoint.lora import tied_layers, tied_note
from titanlite.model_spec import ModelSpec
from titanlite.saved_model import read_dcp

FORMATS = ("dcp", "hf", "torch", "peft")


def _adapter(spec: ModelSpec):
    if spec.hf is None:
        raise ConfigError(f"model '{spec.name}' has no Hugging Face adapter (models/{spec.name}/hf.py)")
    return spec.hf


def convert(src: str, dst: str, src_format: str, dst_format: str, *, model: str = "llama3",
            dtype: str = "", max_shard_gb: float = 5.0) -> str:
    """Writes `dst`; returns what the line saying so adds (a tied layer's adapter: how to use what
    was written)."""
    src_path, dst_path = Path(src), Path(dst)
    cast = (lambda sd: sd) if not dtype else (lambda sd: {k: v.to(getattr(torch, dtype)) for k, v in sd.items()})
    if (src_format, dst_format) == ("dcp", "peft"):
        spec, args, trained, lora = read_dcp(src_path, merged=False)
        if lora is None:
            raise ConfigError(f"{src_path} is not a LoRA run's checkpoint (no adapter); convert it to hf")
        base = read_info(src_path)["transform"]["base"]["path"]
        write_peft(dst_path, *to_peft(trained, lora, _adapter(spec), args, model_shapes(spec, args), base))
        return tied_note(tied_layers(spec, args, lora.targets), str(src_path))
    elif (src_format, dst_format) == ("dcp", "hf"):
        spec, args, sd, lora = read_dcp(src_path)
        adapter = _adapter(spec)
        if lora is not None and tied_layers(spec, args, lora.targets):
            # the adapter made the output its own weight: written untied, with lm_head.weight
            args = dataclasses.replace(args, tie_embeddings=False)
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
        spec, args, sd, lora = read_dcp(src_path)
        dst_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(cast(sd), dst_path)
        untied = {} if lora is None else tied_layers(spec, args, lora.targets)
        if untied:  # loaded into the tied model, one of the two weights would silently take both places
            layer, other = min(untied.items())
            return (f"; {layer} is tied to {other.removesuffix('.weight')} in the model, not in this file (its adapter "
                    f"changed {layer} alone): load it into the model built untied (its args' tie_embeddings=False)")
    else:
        raise ConfigError(f"cannot convert {src_format} to {dst_format}; supported: dcp->hf, hf->dcp, dcp->torch, "
                          "dcp->peft")
    return ""


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
        note = convert(a.src, a.dst, a.src_format, a.dst_format, model=a.model, dtype=a.dtype,
                       max_shard_gb=a.max_shard_gb)
    except ConfigError as e:
        sys.exit(f"titanlite: error: {e}")
    print(f"titanlite: wrote {a.dst} ({a.dst_format}){note}")


if __name__ == "__main__":
    main()
