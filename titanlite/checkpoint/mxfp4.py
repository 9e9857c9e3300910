"""MXFP4 tensors in safetensors files, as gpt-oss publishes its experts' weights.

A weight `<name>` of shape [..., rows, cols] is stored as two tensors (the OCP microscaling
format with 32-value blocks): `<name>_blocks`, uint8 [..., rows, cols / 32, 16], FP4 (e2m1)
values packed two per byte, the low nibble first; and `<name>_scales`, uint8 [..., rows,
cols / 32], one e8m0 exponent per block, the block's values being multiplied by 2^(scale - 127).
"""

from __future__ import annotations

from pathlib import Path

import torch

from titanlite.errors import ConfigError

BLOCK = 32
"""Values per block (and per scale)."""
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 FP4 values, by their 4-bit code: sign, two exponent bits, one mantissa bit."""
BLOCKS, SCALES = "_blocks", "_scales"


def check(blocks: tuple[str, tuple[int, ...], str], scales: tuple[str, tuple[int, ...], str] | None,
          where: str | Path) -> None:
    """Refuse a malformed pair in one line naming the key and `where` (its file): each is
    (key, shape, safetensors dtype such as "U8"); `scales` None when it is missing."""
    key, shape, dtype = blocks
    if scales is None:
        raise ConfigError(f"{key} in {where}: MXFP4 blocks without their {key.removesuffix(BLOCKS)}{SCALES}; "
                          "the checkpoint is incomplete")
    if dtype != "U8" or len(shape) < 2 or shape[-1] != BLOCK // 2:
        raise ConfigError(f"{key} in {where}: MXFP4 blocks must be uint8 [..., {BLOCK // 2}] (two FP4 values a "
                          f"byte), got {dtype} {list(shape)}; the file is not an MXFP4 checkpoint")
    skey, sshape, sdtype = scales
    if sdtype != "U8" or tuple(sshape) != tuple(shape[:-1]):
        raise ConfigError(f"{skey} in {where}: MXFP4 scales must be uint8 {list(shape[:-1])} (one per block "
                          f"of {key}), got {sdtype} {list(sshape)}")


def check_headers(headers: dict[str, tuple[Path, tuple[int, ...], str]]) -> None:
    """Every `*_blocks` entry of {key: (file, shape, dtype)} against its `*_scales`."""
    for key, (path, shape, dtype) in headers.items():
        if key.endswith(BLOCKS):
            partner = key.removesuffix(BLOCKS) + SCALES
            scales = headers.get(partner)
            check((key, shape, dtype), None if scales is None else (partner, scales[1], scales[2]), path)
        elif key.endswith(SCALES) and key.removesuffix(SCALES) + BLOCKS not in headers:
            raise ConfigError(f"{key} in {path}: MXFP4 scales without their "
                              f"{key.removesuffix(SCALES)}{BLOCKS}; the checkpoint is incomplete")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., G, 16] and scales [..., G] -> [..., G * 32] in `dtype` (meta in, meta out)."""
    shape = (*blocks.shape[:-2], blocks.shape[-2] * BLOCK)
    if blocks.is_meta:
        return torch.empty(shape, dtype=dtype, device="meta")
    table = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1).flatten(-2)
    # e8m0: a power of two, exact in float32 (255, NaN in the format, is out of any real checkpoint)
    return torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127).reshape(shape).to(dtype)
