"""Generation on CPU: titanlite's generate against transformers' generate on the same weights, and
each attention kind's cache against its formula.

    OMP_NUM_THREADS=1 python -m titanlite.tools.bench_generate [--flavor debugmodel] [--prompt 128] [--new 64]
        [--batch 1] [--rounds 3]

Speed: a random llama3 `--flavor` (debugmodel, 100M, 1B, ...) written as a transformers folder;
both generate greedily from the same `--batch` prompts of `--prompt` tokens, interleaved round
after round, each keeping its best round (on a shared machine the rounds others slowed down drop
out). Prefill is the run of one new token; decode is (the run of `--new` tokens - prefill) /
(`--new` - 1) per step. Prints a Markdown table.

Memory: every kind of past on a tiny model of its family (GQA: llama3; sliding windows with sinks:
gpt-oss; MLA: DeepSeek-V3; Gated DeltaNet with gated attention: Qwen3.5), the bytes the cache holds
after a generation against the formula (titanlite.layers.cache.cache_bytes, which the dry run's
--generate reports); then the formula for published flavors at 32k tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from typing import Any

import torch

import titanlite
from titanlite.generate import generate
from titanlite.layers.cache import Cache, cache_bytes
from titanlite.model_spec import get_model_spec


def measured_cache(family: str, flavor: str, batch: int, prompt: int, new: int) -> tuple[int, Any]:
    """The bytes titanlite's cache holds after generating `new` tokens from `batch` prompts."""
    spec = get_model_spec(family)
    args = dataclasses.replace(spec.flavors[flavor], max_seq_len=prompt + new)
    model = spec.build(args).eval()
    caches = []
    real = Cache.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        caches.append(self)

    Cache.__init__ = spy
    try:
        generate(model, [[1] * prompt] * batch, new - 1)  # the last token is never fed
    finally:
        Cache.__init__ = real
    return caches[0].nbytes(), args


def memory_table(batch: int, prompt: int, new: int) -> None:
    print("\n| kind (tiny model) | rows x tokens | cache bytes | formula | equal |")
    print("|---|---:|---:|---:|---|")
    kinds = {"GQA (llama3)": ("llama3", "debugmodel"), "sliding + sinks (gpt_oss)": ("gpt_oss", "debugmodel"),
             "MLA (deepseek_v3)": ("deepseek_v3", "debugmodel"), "Gated DeltaNet + full (qwen3_5)": ("qwen3_5", "debugmodel")}
    for name, (family, flavor) in kinds.items():
        got, args = measured_cache(family, flavor, batch, prompt, new)
        want = cache_bytes(args, batch, prompt + new - 1)
        print(f"| {name} | {batch} x {prompt + new - 1} | {got:,} | {want:,} | {got == want} |")
    print("\n| published flavor (bf16, one row of 32768 tokens) | cache GiB |")
    print("|---|---:|")
    for family, flavor in (("llama3", "8B"), ("llama3", "70B"), ("gpt_oss", "120B"), ("deepseek_v3", "671B"),
                           ("qwen3_5", "9B"), ("qwen3_5", "35B-A3B")):
        args = get_model_spec(family).flavors[flavor]
        print(f"| {family} {flavor} | {cache_bytes(args, 1, 32768, 2) / 2**30:.2f} |")


def speed_table(flavor: str, batch: int, prompt: int, new: int, rounds: int) -> None:
    import transformers

    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors[flavor], max_seq_len=prompt + new)
    ours = spec.build(args).eval()
    ours.init_weights(0)
    with tempfile.TemporaryDirectory() as folder:
        titanlite.write_hf(folder, spec.hf.to_hf(ours.state_dict(), args), spec.hf.config_to_hf(args, torch.float32))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(3, args.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    config = lambda n: transformers.GenerationConfig(do_sample=False, max_new_tokens=n, pad_token_id=0,  # noqa: E731
                                                     eos_token_id=None)
    runs = {"titanlite": lambda n: generate(ours, ids.tolist(), n),
            "transformers": lambda n: theirs.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                                      generation_config=config(n))}
    best = {(name, n): float("inf") for name in runs for n in (1, new)}
    with torch.no_grad():
        for _ in range(rounds):
            for (name, n) in best:
                t0 = time.perf_counter()
                runs[name](n)
                best[name, n] = min(best[name, n], time.perf_counter() - t0)
    print(f"| llama3 {flavor}, {batch} x {prompt} prompt tokens, {new} new | prefill tokens/s | decode tokens/s |")
    print("|---|---:|---:|")
    rates = {}
    for name in runs:
        prefill, decode = best[name, 1], (best[name, new] - best[name, 1]) / (new - 1)
        rates[name] = (batch * prompt / prefill, batch / decode)
        print(f"| {name} | {rates[name][0]:,.0f} | {rates[name][1]:,.1f} |")
    ratio = [a / b for a, b in zip(rates["titanlite"], rates["transformers"])]
    print(f"| titanlite / transformers | {ratio[0]:.2f}x | {ratio[1]:.2f}x |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m titanlite.tools.bench_generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="debugmodel", help="llama3 flavor timed")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    speed_table(a.flavor, a.batch, a.prompt, a.new, a.rounds)
    memory_table(2, 40, 24)


if __name__ == "__main__":
    main()
