"""Start-up time and peak memory of a rank's loader against corpus size: a raw source
(tokenized at start) vs. a token folder (python -m titanlite.tools.tokenize, read by index).

    OMP_NUM_THREADS=1 python -m titanlite.tools.bench_tokens [--mb 12 120] [--workers 2] [--bpe VOCAB]

Writes a jsonl corpus of each size (standard-library text, repeated), then in a fresh process
each: builds the training loader of one rank (byte tokenizer, or with --bpe a byte-level BPE
tokenizer the script trains; seq_len 2048, batch 8, shuffled) and takes 10 batches, reporting
the seconds to the first batch and the peak RSS. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from titanlite.data.sources import read_documents

PROBE = """
import resource, sys, time
start = time.perf_counter()
from titanlite.config.data import Data
from titanlite.data.loader import build_dataloader
from titanlite.data.tokenizer import build_tokenizer
tokenizer = build_tokenizer(sys.argv[2])
imported = time.perf_counter()
it = iter(build_dataloader(Data(path=sys.argv[1], tokenizer=sys.argv[2]), tokenizer, seq_len=2048, global_batch_size=8,
                           local_batch_size=8, dp_rank=0, dp_degree=1))
next(it)
first = time.perf_counter()
for _ in range(9):
    next(it)
print(first - imported, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
"""


def probe(path: str, tokenizer: str, env: dict) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", PROBE, path, tokenizer], check=True, capture_output=True,
                         text=True, env=env)
    seconds, gib = out.stdout.split()
    return float(seconds), float(gib)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, nargs="+", default=[12, 120], help="corpus sizes in MB of text")
    ap.add_argument("--workers", type=int, default=2, help="tokenizer processes")
    ap.add_argument("--bpe", type=int, default=0, help="train and use a BPE tokenizer of this many ids")
    a = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    tmp = Path(tempfile.mkdtemp(prefix="titanlite-bench-tokens-"))
    texts = read_documents("", "text", "train")
    lines = [json.dumps({"text": t}) + "\n" for t in texts]
    per_pass = sum(len(t) for t in texts)
    tokenizer = "byte"
    if a.bpe:
        from titanlite.tools.bench_data import make_tokenizer

        tokenizer = str(tmp / "bpe")
        make_tokenizer(texts[: len(texts) // 4], tmp / "bpe", a.bpe)
    rows = []
    for mb in a.mb:
        corpus, folder = tmp / f"{mb:g}MB.jsonl", tmp / f"{mb:g}MB-tokens"
        with open(corpus, "w") as f:
            for _ in range(max(1, round(mb * 1e6 / per_pass))):
                f.writelines(lines)
        raw = probe(str(corpus), tokenizer, env)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "titanlite.tools.tokenize", "--data.path", str(corpus), "--out",
                        str(folder), "--workers", str(a.workers), "--data.tokenizer", tokenizer],
                       check=True, capture_output=True, env=env)
        tokenize_s = time.perf_counter() - start
        tokens = json.loads((folder / "index.json").read_text())["num_tokens"]
        rows.append((corpus.stat().st_size / 1e6, tokens, raw, tokenize_s, probe(str(folder), tokenizer, env)))
        corpus.unlink()
    print(f"{'BPE (%d ids)' % a.bpe if a.bpe else 'byte'} tokenizer, seq_len 2048, batch 8, 1 rank; tokenize with {a.workers} worker processes\n")
    print("| corpus | tokens | raw source: start-up s | raw: peak RSS GiB | tokenize once, s "
          "| token folder: start-up s | folder: peak RSS GiB |\n|---:|---:|---:|---:|---:|---:|---:|")
    for size, tokens, (raw_s, raw_gib), tok_s, (dir_s, dir_gib) in rows:
        print(f"| {size:,.0f} MB | {tokens:,} | {raw_s:.2f} | {raw_gib:.2f} | {tok_s:.1f} | {dir_s:.3f} | {dir_gib:.2f} |")


if __name__ == "__main__":
    main()
