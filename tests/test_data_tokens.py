"""Token folders: python -m titanlite.tools.tokenize, training from one, refusals, flat memory."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_data import BYTE, hf_folder, write_jsonl  # noqa: F401 (fixture)

from titanlite.config import load as config_load
from titanlite.config.data import Data
from titanlite.data.loader import build_dataloader, split_stream, token_stream
from titanlite.data.tokenizer import build_tokenizer
from titanlite.data.tokens import TokenFolderWriter, TokenShards, encode_documents
from titanlite.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "titanlite.tools.tokenize", *args], capture_output=True,
                          text=True, cwd=REPO, env=ENV, timeout=120)


def batches(cfg: Data, tok, steps: int, *, D: int = 2, L: int = 2, split: str = "train") -> list[dict]:
    out = []
    for r in range(D):
        it = iter(build_dataloader(cfg, tok, seq_len=16, global_batch_size=8, local_batch_size=L,
                                   dp_rank=r, dp_degree=D, split=split))
        out += [next(it) for _ in range(steps * 8 // (L * D))]
    return out


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def test_tokenize_command_and_training_from_the_folder(tmp_path, hf_folder):  # noqa: F811
    corpus = write_jsonl(tmp_path / "docs.jsonl", 300)
    out = tmp_path / "tokens"
    proc = run_tool("--data.path", str(corpus), "--data.tokenizer", str(hf_folder), "--out", str(out),
                    "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    assert "tokenizing" in proc.stderr and "300 docs" in proc.stderr  # the progress bar
    index = json.loads((out / "index.json").read_text())
    assert index["dtype"] == "uint16" and index["num_documents"] == 300
    tok = build_tokenizer(str(hf_folder))
    raw, folder = token_stream(str(corpus), "text", tok), token_stream(str(out), "text", tok)
    assert isinstance(folder.tokens, TokenShards) and np.array_equal(raw.tokens, folder.tokens)
    assert np.array_equal(raw.doc_starts, folder.doc_starts)
    for kw, split in [({}, "train"), ({"document_mask": True, "holdout_fraction": 0.2}, "val")]:
        a = batches(Data(path=str(corpus), **kw), tok, 3, split=split)
        b = batches(Data(path=str(out), **kw), tok, 3, split=split)
        assert same(a, b), (kw, split)
    # the cursor means the same on another dp degree: resume rank 1 of 4 after 2 steps of 1 rank
    one = build_dataloader(Data(path=str(out)), tok, seq_len=16, global_batch_size=8, local_batch_size=8,
                           dp_rank=0, dp_degree=1)
    it = iter(one)
    next(it), next(it)
    state, expected = one.state_dict(), next(it)["input_ids"]
    part = build_dataloader(Data(path=str(out)), tok, seq_len=16, global_batch_size=8, local_batch_size=2,
                            dp_rank=1, dp_degree=4)
    part.load_state_dict(state)
    assert torch.equal(next(iter(part))["input_ids"], expected[2:4])
    again = run_tool("--data.path", str(corpus), "--out", str(out))
    assert again.returncode == 1 and again.stderr == f"titanlite: error: --out: '{out}' is not empty; name a new folder\n"


def test_shards_read_as_one_stream(tmp_path, monkeypatch):
    from titanlite.tools import tokenize as tool

    corpus = write_jsonl(tmp_path / "docs.jsonl", 200, seed=3)
    monkeypatch.setattr(tool, "CHUNK_DOCS", 16)
    counts = tool.tokenize(["--data.path", str(corpus)], str(tmp_path / "tk"), workers=1, shard_tokens=1000)
    index = json.loads((tmp_path / "tk" / "index.json").read_text())
    assert len(index["shards"]) > 3 and counts["tokens"] == sum(s["tokens"] for s in index["shards"])
    raw, folder = token_stream(str(corpus), "text", BYTE), token_stream(str(tmp_path / "tk"), "text", BYTE)
    assert isinstance(folder.tokens, TokenShards) and len(folder.tokens) == len(raw.tokens)
    for a, b in [(0, 10), (990, 1210), (995, 4000), (0, len(raw.tokens)), (500, 500)]:  # across shard ends
        assert np.array_equal(np.asarray(folder.tokens[a:b]), raw.tokens[a:b])
        assert np.array_equal(np.asarray(folder.tokens[a:][:b - a], dtype=np.int64), raw.tokens[a:b])
    for split in ("train", "val"):
        x, y = split_stream(raw, 0.1, split), split_stream(folder, 0.1, split)
        assert np.array_equal(x.tokens, np.asarray(y.tokens)) and np.array_equal(x.doc_starts, y.doc_starts)
    kw = dict(shuffle=True, document_mask=True)
    assert same(batches(Data(path=str(corpus), **kw), BYTE, 4, D=2, L=4),
                batches(Data(path=str(tmp_path / "tk"), **kw), BYTE, 4, D=2, L=4))


def test_a_key_the_source_ignores_gets_a_warning(tmp_path):
    """The trainer's rank 0 prints this line at start-up: a token folder reads no split or text
    field, a .jsonl file no split; keys left at their defaults say nothing."""
    from titanlite.data.loader import ignored_keys_note
    from titanlite.tools import tokenize as tool

    corpus = write_jsonl(tmp_path / "docs.jsonl", 20)
    tool.tokenize(["--data.path", str(corpus)], str(tmp_path / "tk"), workers=1, shard_tokens=1000)
    note = ignored_keys_note(Data(path=str(tmp_path / "tk"), split="validation", text_field="body"))
    assert note == (f"titanlite: warning: data.split = 'validation', data.text_field = 'body': ignored by this "
                    f"run's data source, '{tmp_path / 'tk'}'; leave them out or check data.path")
    assert ignored_keys_note(Data(path=str(tmp_path / "tk"))) is None
    assert ignored_keys_note(Data(path=str(corpus), text_field="body")) is None  # a .jsonl reads its field
    assert ignored_keys_note(Data(path=str(corpus), split="x")).startswith("titanlite: warning: data.split = 'x': ")
    # text reads no messages; chats read no text field, the built-in chat set no field at all
    assert ignored_keys_note(Data(path=str(corpus), train_on="last")).startswith(
        "titanlite: warning: data.train_on = 'last': ignored by")
    assert ignored_keys_note(Data(format="chat", text_field="body", messages_field="m")).startswith(
        "titanlite: warning: data.text_field = 'body', data.messages_field = 'm': ignored by")
    assert ignored_keys_note(Data(path=str(corpus), format="chat", messages_field="m")) is None
    # chats are rendered from their rows at start-up, never from a token folder
    with pytest.raises(ConfigError, match="data.format chat: chats are rendered and packed whole at start-up"):
        tool.tokenize(["--data.path", str(corpus), "--data.format", "chat", "--data.document_mask", "true",
                       "--data.tokenizer", "byte_chat"], str(tmp_path / "tk2"), workers=1, shard_tokens=1000)
    with pytest.raises(ConfigError, match="is a token folder, which holds tokens, not messages rows"):
        build_dataloader(Data(path=str(tmp_path / "tk"), format="chat", document_mask=True, tokenizer="byte_chat"),
                         build_tokenizer("byte_chat"), seq_len=64, global_batch_size=1, local_batch_size=1,
                         dp_rank=0, dp_degree=1)


def test_token_folder_refusals(tmp_path, hf_folder):  # noqa: F811
    from titanlite.preflight import preflight

    folder = tmp_path / "tk"
    writer = TokenFolderWriter(folder, BYTE, "byte", 10**6)
    writer.write(*encode_documents(["abc" * 100] * 20, BYTE))
    with pytest.raises(ConfigError, match="unfinished token folder .* --out to a new folder"):
        preflight(config_load.load(["--data.path", str(folder)])[0], 1)  # no index.json yet
    writer.finish({"path": "x", "text_field": "text", "split": "train"})
    preflight(config_load.load(["--data.path", str(folder)])[0], 1)
    with pytest.raises(ConfigError, match=f"'{folder}' was tokenized with data.tokenizer 'byte', which is "
                                          "not this run's tokenizer"):
        preflight(config_load.load(["--data.path", str(folder), "--data.tokenizer", str(hf_folder)])[0], 1)
    with pytest.raises(ConfigError, match="data.streaming: .* is a token folder"):
        next(iter(build_dataloader(Data(path=str(folder), streaming=True), BYTE, seq_len=16, global_batch_size=8,
                                   local_batch_size=8, dp_rank=0, dp_degree=1)))
    with pytest.raises(ConfigError, match="is not empty; name a new folder"):
        TokenFolderWriter(folder, BYTE, "byte", 10**6)
    with open(folder / "tokens-00000.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ConfigError, match=r"tokens-00000\.bin holds 100 bytes, not the 12080 that index.json says; the folder is damaged"):
        preflight(config_load.load(["--data.path", str(folder)])[0], 1)


MEMORY_SCRIPT = """
import resource, sys
from titanlite.config.data import Data
from titanlite.data.loader import build_dataloader
from titanlite.data.tokenizer import ByteTokenizer
loader = build_dataloader(Data(path=sys.argv[1], document_mask=True), ByteTokenizer(), seq_len=512,
                          global_batch_size=8, local_batch_size=4, dp_rank=1, dp_degree=2)
for _, _ in zip(loader, range(20)):
    pass
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def test_memory_does_not_grow_with_the_corpus(tmp_path):
    """Peak RSS of building a loader and taking 20 batches from a token folder of 3M and of
    30M tokens (60 MB on disk, 240 MB as the int64 samples would be in memory)."""
    rng = np.random.default_rng(0)
    peaks = []
    for n_docs in (3_000, 30_000):
        writer = TokenFolderWriter(tmp_path / str(n_docs), BYTE, "byte", 2**30)
        for _ in range(n_docs // 1000):
            lengths = rng.integers(500, 1500, 1000)
            writer.write(rng.integers(0, 256, int(lengths.sum()), dtype=np.uint16), lengths)
        writer.finish({"path": "random", "text_field": "text", "split": "train"})
        proc = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path / str(n_docs))],
                              capture_output=True, text=True, cwd=REPO, env=ENV, check=True, timeout=120)
        peaks.append(int(proc.stdout.split()[-1]) * 1024)
    assert peaks[1] - peaks[0] < 0.1 * 2**30, peaks
