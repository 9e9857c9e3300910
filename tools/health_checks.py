"""The measurements `titanlite.tools.healthcheck` takes on each rank: device rates, collective bus
bandwidth, a tiny model's losses on the device against the host CPU, and the feature checks.

Every function measures and returns figures; judging them (shares, bands, PASS/FAIL) is
healthcheck.py's. Sizes shrink on CPU, where the run is a smoke test over gloo.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titanlite.layers import init
from titanlite.layers.attention import AttnContext, AttnSetup
from titanlite.model_spec import get_model_spec, model_args
from titanlite.tools.bench import matmul_rate

NUMERICS_STEPS = 5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn, device: torch.device, repeats: int = 6) -> float:
    """The fastest of `repeats` timed calls after one warm-up: the device's rate, not its
    neighbours' (a shared host, a concurrent job) noise."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def device_rates(device: torch.device) -> dict:
    """bf16 dense matmul FLOP/s (fp32 on CPU, whose bf16 matmul is emulated) and memory bandwidth
    as a device-to-device copy moves it (bytes read + written)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = (1 << 28) if device.type == "cuda" else (1 << 22)  # 512 MiB or 8 MiB of bf16/fp32 per buffer
    src = torch.empty(n, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    seconds = best_seconds(lambda: dst.copy_(src), device)
    return {"matmul_tflops": matmul_rate(device, dtype) / 1e12, "membw_gbps": 2 * n * 2 / seconds / 1e9,
            "matmul_dtype": str(dtype).removeprefix("torch.")}


def bus_bandwidth(kind: str, device: torch.device, group: dist.ProcessGroup | None) -> float:
    """nccl-tests' bus bandwidth in GB/s of an all-reduce or all-gather over `group`: the bytes
    each rank moves on its link per second, comparable with the link's own figure."""
    n = dist.get_world_size(group)
    elems = (1 << 27) if device.type == "cuda" else (1 << 18)  # 256 MiB or 512 KiB of bf16 per rank
    x = torch.ones(elems, dtype=torch.bfloat16, device=device)
    if kind == "all_reduce":
        seconds = best_seconds(lambda: dist.all_reduce(x, group=group), device, repeats=4)
        return 2 * (n - 1) / n * x.numel() * 2 / seconds / 1e9
    out = torch.empty(n * elems, dtype=torch.bfloat16, device=device)
    seconds = best_seconds(lambda: dist.all_gather_into_tensor(out, x, group=group), device, repeats=4)
    return (n - 1) / n * out.numel() * 2 / seconds / 1e9


def _tiny_model(device: torch.device, dtype: torch.dtype):
    spec = get_model_spec("llama3")
    args = model_args(spec, "debugmodel", 0, 64)
    with torch.device("meta"):
        model = spec.build(args)
    # drawn on the host: init's generators live on the parameter's device, and CUDA's draws other
    # numbers than the CPU's, so a model initialised on the GPU is another model than the host's
    init.materialize(model, torch.device("cpu"), seed=0)
    return model.to(device=device, dtype=dtype)


def tiny_losses(device: torch.device, dtype: torch.dtype = torch.float32, compiled: bool = False,
                steps: int = NUMERICS_STEPS) -> list[float]:
    """The first `steps` losses of the debug Llama (the same seed-defined weights everywhere)
    trained with AdamW on one fixed batch: a function of the device's arithmetic alone."""
    model = _tiny_model(device, dtype)
    forward = torch.compile(model, backend="inductor" if device.type == "cuda" else "aot_eager") \
        if compiled else model
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4, 65), generator=gen).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    losses = []
    for _ in range(steps):
        ctx = AttnContext(seq_len=64, device=device)
        logits = forward(tokens[:, :-1], ctx)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_flex(device: torch.device) -> tuple[str, str]:
    """FlexAttention forward + backward against SDPA on the same inputs (documents mask), float32."""
    if device.type != "cuda":
        return "SKIP", f"torch {torch.__version__} has no FlexAttention backward on CPU"
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return "SKIP", f"torch {torch.__version__} has no FlexAttention"
    return _attention_pair(device, "flex", torch.float32, 1e-3)


def check_varlen(device: torch.device) -> tuple[str, str]:
    """The variable-length kernel over packed documents against SDPA's blocked path, bf16."""
    if device.type != "cuda":
        return "SKIP", "varlen runs on CUDA only"
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return "SKIP", f"torch {torch.__version__} has no torch.nn.attention.varlen"
    return _attention_pair(device, "varlen", torch.bfloat16, 5e-2)  # two bf16 kernels: ~1e-2 apart


def _attention_pair(device: torch.device, backend: str, dtype: torch.dtype, tol: float) -> tuple[str, str]:
    from titanlite.layers.attention import attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 256, 64, generator=gen).to(device, dtype) for h in (8, 2, 2))
    docs = (torch.arange(256) // 100).expand(2, 256).to(device)
    grad = torch.randn(2, 8, 256, 64, generator=gen).to(device, dtype)
    results = []
    for name in ("sdpa", backend):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        ctx = AttnSetup(backend=name, windows=(None,)).context(document_ids=docs, seq_len=256, device=device)
        out = attention(*leaves, ctx)
        out.backward(grad)
        results.append([out.detach(), *(x.grad for x in leaves)])
    err = max(_rel_error(a, b) for a, b in zip(results[1], results[0]))
    status = "PASS" if err <= tol else "FAIL"
    return status, f"max relative error of output and dq/dk/dv vs sdpa {err:.1e} (bound {tol:.0e})"


def check_compile(device: torch.device) -> tuple[str, str]:
    """The debug model's first losses compiled against eager (inductor on CUDA; aot_eager on CPU,
    where the CPU suite's compile tests cover inductor and a cold compile costs minutes)."""
    eager = tiny_losses(device, steps=2)
    compiled = tiny_losses(device, compiled=True, steps=2)  # the second step runs compiled backward's update
    err = max(abs(a - b) for a, b in zip(eager, compiled))
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    return ("PASS" if err <= 1e-3 else "FAIL"), f"{backend}: loss differs from eager by {err:.1e} (bound 1e-3)"


def check_float8(device: torch.device) -> tuple[str, str]:
    """torchao's float8 Linear (tensorwise) forward + backward against bf16 on the same weights."""
    if importlib.util.find_spec("torchao") is None:
        return "SKIP", "torchao is not installed"
    if device.type != "cuda":
        return "SKIP", "float8 matmuls need a CUDA GPU"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return "SKIP", f"{torch.cuda.get_device_name(device)} has no float8 matmuls (compute capability < 8.9)"
    from titanlite.config.job import Float8
    from titanlite.parallel.float8 import apply_float8

    gen = torch.Generator().manual_seed(0)
    ref = torch.nn.Linear(1024, 4096, bias=False).to(device, torch.bfloat16)
    f8 = torch.nn.Sequential(torch.nn.Linear(1024, 4096, bias=False)).to(device, torch.bfloat16)
    f8[0].load_state_dict(ref.state_dict())
    apply_float8([f8], dataclasses.replace(Float8(), enable=True), fsdp=False)
    x = torch.randn(4096, 1024, generator=gen).to(device, torch.bfloat16)
    grad = torch.randn(4096, 4096, generator=gen).to(device, torch.bfloat16)
    outs = []
    for layer in (ref, f8[0]):
        out = layer(x)
        out.backward(grad)
        outs.append([out.detach(), layer.weight.grad])
    # e4m3 inputs and weights (3 mantissa bits) give the output ~5% relative error, the e5m2
    # gradient (2 bits) the weight gradient ~8%; a broken float8 matmul is off by ~100%
    err = max(_rel_error(a, b) for a, b in zip(outs[1], outs[0]))
    status = "PASS" if err <= 0.15 else "FAIL"
    return status, f"relative error of output and weight gradient vs bf16 {err:.1e} (bound 0.15)"


FEATURES = {"compile": check_compile, "float8": check_float8, "flex": check_flex, "varlen": check_varlen}


def features(device: torch.device) -> dict[str, tuple[str, str]]:
    """Each feature's status and one-line reason; a feature that raises is a FAIL naming the error."""
    rows = {}
    for name, check in FEATURES.items():
        try:
            rows[name] = check(device)
        except Exception as e:  # noqa: BLE001  (reported as the row's reason, not hidden)
            rows[name] = ("FAIL", f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}")
    return rows
