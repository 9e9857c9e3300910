"""Data loader throughput (tokens/s) with a Hugging Face BPE tokenizer vs. what training consumes.

    OMP_NUM_THREADS=1 python -m titanlite.tools.bench_data [--seq-len 256] [--batch 8] [--mb 4]

Trains a byte-level BPE tokenizer on part of the standard library, writes a jsonl corpus, then
measures (1) the one-off tokenize-and-pack pass of the map-style loader, (2) its steady
iteration, (3) the streaming loader (tokenizing on the fly), and (4) training the debug model
on the same data with `python -m titanlite.train`. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from titanlite.config.data import Data  # noqa: E402
from titanlite.data.loader import build_dataloader, token_stream  # noqa: E402
from titanlite.data.sources import read_documents  # noqa: E402
from titanlite.data.tokenizer import build_tokenizer  # noqa: E402


def make_tokenizer(texts: list[str], folder: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(folder)


def loader_rate(cfg: Data, tok, seq_len: int, batch: int, seconds: float) -> float:
    loader = build_dataloader(cfg, tok, seq_len=seq_len, global_batch_size=batch, local_batch_size=batch,
                              dp_rank=0, dp_degree=1)
    it = iter(loader)
    next(it)  # start-up (worker spawn, first read) is not steady state
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        n += next(it)["input_ids"].numel()
    return n / (time.perf_counter() - start)


def train_rate(corpus: Path, tok_folder: Path, vocab: int, seq_len: int, batch: int, dump: Path) -> float:
    with socket.socket() as s:  # a free port: other jobs may hold the default one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_PORT": str(port), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "titanlite.train", "--model.flavor", "debugmodel",
           "--model.vocab_size", str(vocab), "--data.path", str(corpus), "--data.tokenizer", str(tok_folder),
           "--training.seq_len", str(seq_len), "--training.local_batch_size", str(batch),
           "--training.steps", "12", "--metrics.log_freq", "4", "--lr_scheduler.warmup_steps", "2",
           "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(dump)]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, capture_output=True)
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return rows[-1]["tokens_per_sec"]  # steps 9-12: past compile/warm-up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--mb", type=float, default=4.0, help="corpus size in MB of text")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seconds", type=float, default=5.0, help="per loader measurement")
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="titanlite-bench-data-"))
    texts, size = [], 0
    for t in read_documents("", "text", "train"):
        texts.append(t)
        size += len(t)
        if size >= a.mb * 1e6:
            break
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    make_tokenizer(texts[: len(texts) // 4], tmp / "tok", a.vocab)
    tok = build_tokenizer(str(tmp / "tok"))

    start = time.perf_counter()
    n_tokens = len(token_stream(str(corpus), "text", tok).tokens)
    pack = n_tokens / (time.perf_counter() - start)
    rows = [("map-style: tokenize + pack the corpus (once, up front)", pack)]
    for workers in (0, 2):
        rows.append((f"map-style: iterate, num_workers={workers}",
                     loader_rate(Data(path=str(corpus), num_workers=workers), tok, a.seq_len, a.batch, a.seconds)))
    rows.append(("streaming: read + tokenize + pack on the fly, num_workers=0",
                 loader_rate(Data(path=str(corpus), streaming=True), tok, a.seq_len, a.batch, a.seconds)))
    train = train_rate(corpus, tmp / "tok", a.vocab, a.seq_len, a.batch, tmp / "run")

    print(f"corpus: {size / 1e6:.1f} MB, {n_tokens:,} tokens, BPE vocab {tok.vocab_size}; "
          f"batch {a.batch} x {a.seq_len}; torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}\n")
    print("| stage | tokens/s | x training |\n|---|---:|---:|")
    for name, rate in rows:
        print(f"| {name} | {rate:,.0f} | {rate / train:,.1f} |")
    print(f"| training debugmodel (CPU, 1 process) | {train:,.0f} | 1.0 |")


if __name__ == "__main__":
    main()
