"""Scoring speed on CPU: `python -m titanlite.eval`'s model class against lm-eval's own `hf` model on
the same weights and the same local multiple-choice task.

    OMP_NUM_THREADS=1 python -m titanlite.tools.bench_eval [--flavor debugmodel] [--rows 64] [--batch 8] [--rounds 3]

A random llama3 `--flavor` written as a step folder and a transformers folder (byte-level chat
tokenizer); a task of `--rows` questions of 4 choices (4 x rows loglikelihood requests) as an
lm-eval YAML over a local jsonl; both scored through lm_eval.simple_evaluate at `--batch`,
interleaved round after round, each keeping its best round (on a shared machine the rounds others
slowed down drop out). Prints a Markdown table of requests per second: of the whole
simple_evaluate call (with lm-eval's own per-run work, the same for both: building the requests,
computing metrics, collecting environment information) and of the model's `loglikelihood` alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        os.environ.setdefault(key, "1")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    import titanlite
    from titanlite.checkpoint.folder import write_model_checkpoint
    from titanlite.data.tokenizer import byte_chat_tokenizer
    from titanlite.eval.harness import TitanliteLM
    from titanlite.model_spec import get_model_spec

    tok = byte_chat_tokenizer()
    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors[a.flavor], vocab_size=tok.vocab_size, max_seq_len=256)
    model = spec.build(args)
    model.init_weights(0)
    tmp = Path(tempfile.mkdtemp(prefix="bench_eval-"))
    write_model_checkpoint(tmp / "step-1", model.state_dict(), "llama3", args)
    titanlite.write_hf(tmp / "hf", spec.hf.to_hf(model.state_dict(), args), spec.hf.config_to_hf(args, torch.float32))
    tok.hf.save_pretrained(tmp / "hf")
    rows = [{"context": f"Question {i}: which number follows {i} in counting?\nAnswer:",
             "choices": [f" {i + 1}", f" {i - 1}", f" {2 * i}", " none of these"], "gold": 0} for i in range(a.rows)]
    (tmp / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "bench_mc.yaml").write_text(
        f"task: bench_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp / 'mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{context}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{gold}}\"\nmetric_list:\n  - metric: acc\n")
    manager = TaskManager(include_path=str(tmp))
    models = {"lm-eval hf": lambda: HFLM(pretrained=str(tmp / "hf"), dtype="float32", device="cpu",
                                         batch_size=a.batch),
              "titanlite": lambda: TitanliteLM(str(tmp / "step-1"), tokenizer=str(tmp / "hf"), batch_size=a.batch)}
    built = {name: make() for name, make in models.items()}
    spent = dict.fromkeys(models, 0.0)  # in the model's loglikelihood, this round
    for name, lm in built.items():
        def timed(requests, inner=lm.loglikelihood, name=name):
            start = time.perf_counter()
            out = inner(requests)
            spent[name] += time.perf_counter() - start
            return out
        lm.loglikelihood = timed
    best = {name: float("inf") for name in models}
    best_model = dict(best)
    for _ in range(a.rounds):
        for name, lm in built.items():
            spent[name] = 0.0
            start = time.perf_counter()
            lm_eval.simple_evaluate(model=lm, tasks=["bench_mc"], task_manager=manager, verbosity="ERROR")
            best[name] = min(best[name], time.perf_counter() - start)
            best_model[name] = min(best_model[name], spent[name])
    n = 4 * a.rows
    print(f"| model ({a.flavor}, {n} requests, batch {a.batch}) | requests/s, simple_evaluate | vs hf "
          "| requests/s, loglikelihood alone | vs hf |\n|---|---|---|---|---|")
    for name in models:
        print(f"| {name} | {n / best[name]:.1f} | {best['lm-eval hf'] / best[name]:.2f}x "
              f"| {n / best_model[name]:.1f} | {best_model['lm-eval hf'] / best_model[name]:.2f}x |")


if __name__ == "__main__":
    main()
