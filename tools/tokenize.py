"""Tokenize a source once into a token folder that training reads by index.

    python -m titanlite.tools.tokenize [--config X] [--data.* overrides] --out DIR
        [--workers N] [--shard-tokens N]

The source is the job's data.path (with data.text_field, data.split and data.tokenizer, the
same options as training); --out must be a new or empty folder. Worker processes (--workers,
default: every CPU) encode chunks of documents; the chunks are written in document order, so
the folder's token stream is exactly the one training would build from the source itself.
Train from it with --data.path DIR (and the same data.tokenizer). Format: docs/data.md.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm  # installed with transformers

from titanlite.config import load as config_load
from titanlite.data.sources import iter_documents, source_name
from titanlite.data.tokenizer import Tokenizer, build_tokenizer
from titanlite.data.tokens import TokenFolderWriter, encode_documents
from titanlite.errors import ConfigError

CHUNK_DOCS = 1024  # documents per task: large enough to amortize the trip to a worker
_worker_tokenizer: Tokenizer | None = None


def _init_worker(spec: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = build_tokenizer(spec)


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return encode_documents(texts, _worker_tokenizer)


def _chunks(docs: Iterator[str]) -> Iterator[list[str]]:
    chunk = []
    for text in docs:
        if text:  # empty documents are skipped, as in training
            chunk.append(text)
        if len(chunk) == CHUNK_DOCS:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _encoded(chunks: Iterator[list[str]], spec: str, tokenizer: Tokenizer, workers: int
             ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Encoded chunks in source order; at most 2 per worker in flight, so memory stays flat."""
    if workers == 1:
        yield from (encode_documents(c, tokenizer) for c in chunks)
        return
    import multiprocessing

    # Workers are forked: HF tokenizers' own threads would otherwise deadlock or warn in them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    with multiprocessing.get_context("fork").Pool(workers, _init_worker, (spec,)) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def tokenize(argv: list[str], out: str, workers: int, shard_tokens: int) -> dict[str, int]:
    """Write the token folder; returns its token and document counts."""
    cfg, _ = config_load.load(argv)
    d = cfg.data
    if d.mix:
        raise ConfigError("data.mix: tokenize each source on its own (one --out folder each), "
                          "then mix the folders with data.mix")
    if d.format == "chat":
        raise ConfigError("data.format chat: chats are rendered and packed whole at start-up, never read "
                          "from a token folder; train from the chat rows themselves")
    tokenizer = build_tokenizer(d.tokenizer)
    writer = TokenFolderWriter(Path(out), tokenizer, d.tokenizer, shard_tokens)
    bar = tqdm(desc=f"tokenizing {source_name(d.path)}", unit=" docs", file=sys.stderr)
    for tokens, lengths in _encoded(_chunks(iter_documents(d.path, d.text_field, d.split)),
                                    d.tokenizer, tokenizer, workers):
        writer.write(tokens, lengths)
        bar.update(len(lengths))
        bar.set_postfix(tokens=f"{writer.num_tokens:,}", refresh=False)
    bar.close()
    writer.finish({"path": d.path, "text_field": d.text_field, "split": d.split})
    return {"tokens": writer.num_tokens, "documents": writer.num_docs}


def _option(argv: list[str], name: str, default: str) -> tuple[str, list[str]]:
    """Take `--name VALUE` or `--name=VALUE` out of argv."""
    rest, value, i = [], default, 0
    while i < len(argv):
        key, eq, val = argv[i].partition("=")
        if key == name:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{name} needs a value")
                i, val = i + 1, argv[i + 1]
            value = val
        else:
            rest.append(argv[i])
        i += 1
    return value, rest


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    try:
        out, argv = _option(argv, "--out", "")
        workers, argv = _option(argv, "--workers", str(os.cpu_count() or 1))
        shard_tokens, argv = _option(argv, "--shard-tokens", str(2**30))
        if not out:
            raise ConfigError("--out: name the folder to write the tokens to")
        for name, value in [("--workers", workers), ("--shard-tokens", shard_tokens)]:
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"{name}: expected a positive integer, got '{value}'")
        counts = tokenize(argv, out, int(workers), int(shard_tokens))
    except ConfigError as e:
        sys.exit(f"titanlite: error: {e}")
    print(f"titanlite: wrote {out}: {counts['tokens']:,} tokens in {counts['documents']:,} documents")


if __name__ == "__main__":
    main()
