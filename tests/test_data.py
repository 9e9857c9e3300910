import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from titanlite.config.data import Data
from titanlite.errors import ConfigError
from titanlite.data.loader import token_stream, build_dataloader, split_stream
from titanlite.data.tokenizer import ByteTokenizer, build_tokenizer

BYTE = ByteTokenizer()


def write_jsonl(path: Path, n_docs: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n_docs):  # random numbers: no two 16-token windows coincide
            text = f"doc {i} ✓ " + " ".join(str(rng.randrange(10**6)) for _ in range(rng.randint(5, 60)))
            f.write(json.dumps({"text": text, "id": i}) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "docs.jsonl", 400)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world", "the quick brown fox", "doc alpha beta gamma"] * 10, trainer)
    folder = tmp_path_factory.mktemp("hf_tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>", unk_token="<unk>").save_pretrained(folder)
    return folder


def loader(path, *, G=8, L=4, D=1, rank=0, seq_len=16, **cfg):
    return build_dataloader(Data(path=str(path), **cfg), BYTE, seq_len=seq_len, global_batch_size=G,
                            local_batch_size=L, dp_rank=rank, dp_degree=D)


def global_batches(path, steps, *, G=8, L=4, D=1, **cfg) -> list[torch.Tensor]:
    """Each step's global batch, rebuilt from the micro-batches of all D ranks."""
    iters = [iter(loader(path, G=G, L=L, D=D, rank=r, **cfg)) for r in range(D)]
    accum = G // (L * D)
    out = []
    for _ in range(steps):
        rows = []
        for it in iters:
            for _ in range(accum):
                batch = next(it)
                assert batch["input_ids"].shape == (L, 16) and batch["input_ids"].dtype == torch.long
                assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
                rows.append(torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1))
        out.append(torch.cat(rows))
    return out


def test_byte_tokenizer():
    tok = build_tokenizer("byte")
    text = "héllo wörld ✓\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text
    assert tok.decode([0xFF, 104]) == "\ufffdh"


def test_hf_tokenizer(hf_folder):
    from tokenizers import Tokenizer

    tok = build_tokenizer(str(hf_folder))
    assert tok.vocab_size == Tokenizer.from_file(str(hf_folder / "tokenizer.json")).get_vocab_size()
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    ids = tok.encode("hello world")
    assert ids and tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode(ids) == "hello world"
    assert [a.tolist() for a in tok.encode_batch(["hello world", "fox"])] == [ids, tok.encode("fox")]


def test_hf_tokenizer_without_bos_separates_with_eos(hf_folder, tmp_path):
    config = json.loads((hf_folder / "tokenizer_config.json").read_text())
    config["bos_token"] = None
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text((hf_folder / "tokenizer.json").read_text())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    tok = build_tokenizer(str(tmp_path / "tok"))
    assert tok.bos_id == tok.eos_id == 2
    (tmp_path / "a.txt").write_text("hello world")
    stream = token_stream(str(tmp_path / "a.txt"), "text", tok)
    assert stream.tokens.tolist() == tok.encode("hello world") + [2]


def test_hf_tokenized_loader(hf_folder, corpus):
    tok = build_tokenizer(str(hf_folder))
    batch = next(iter(build_dataloader(Data(path=str(corpus)), tok, seq_len=16, global_batch_size=4,
                                       local_batch_size=4, dp_rank=0, dp_degree=1)))
    assert batch["input_ids"].shape == (4, 16) and int(batch["input_ids"].max()) < tok.vocab_size


def test_tokenizer_folder_without_files(tmp_path):
    with pytest.raises(ConfigError, match="has no tokenizer files"):
        build_tokenizer(str(tmp_path))


@pytest.mark.parametrize("shuffle", [True, False])
def test_layout_independence(corpus, shuffle):
    reference = global_batches(corpus, 3, G=8, L=8, D=1, shuffle=shuffle)
    for D, L in [(1, 2), (2, 4), (2, 1), (4, 2), (4, 1)]:
        got = global_batches(corpus, 3, G=8, L=L, D=D, shuffle=shuffle)
        assert all(torch.equal(a, b) for a, b in zip(reference, got)), (D, L)
    if not shuffle:  # sample i is stream[i*L : i*L + L + 1]
        tokens = torch.from_numpy(token_stream(str(corpus), "text", BYTE).tokens.astype(np.int64))
        assert torch.equal(reference[1][0], tokens[8 * 16:9 * 16 + 1])


def test_ranks_disjoint_and_epochs_reshuffle(tmp_path):
    path = write_jsonl(tmp_path / "small.jsonl", 40)
    train = split_stream(token_stream(str(path), "text", BYTE), 0.01, "train")
    n = (len(train.tokens) - 1) // 16
    for shuffle in (True, False):
        batches = global_batches(path, 2 * n // 8 + 1, G=8, L=2, D=4, shuffle=shuffle)
        ranks = [{tuple(r.tolist()) for b in batches[:n // 8] for r in b[2 * k:2 * k + 2]} for k in range(4)]
        assert sum(map(len, ranks)) == len(set().union(*ranks)) == n // 8 * 8  # no sample twice
        flat = [tuple(r.tolist()) for b in batches for r in b]
        epoch0, epoch1 = flat[:n], flat[n:2 * n]
        assert set(epoch0) == set(epoch1) and len(set(epoch0)) == n
        assert (epoch0 != epoch1) == shuffle


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_resume(corpus, num_workers):
    kw = dict(G=8, L=2, D=2, rank=1, num_workers=num_workers)
    original = loader(corpus, **kw)
    it = iter(original)
    for _ in range(5):  # mid-step: 2 micro-batches per step
        next(it)
    state = original.state_dict()
    expected = [next(it) for _ in range(6)]
    resumed = loader(corpus, **kw)
    resumed.load_state_dict(state)
    got = [b for b, _ in zip(resumed, range(6))]
    for a, b in zip(expected, got):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


def test_resume_on_other_dp_degree(corpus):
    single = loader(corpus, G=8, L=8, D=1)
    it = iter(single)
    next(it), next(it)
    state = single.state_dict()
    expected = next(it)["input_ids"]
    rows = []
    for r in range(2):
        part = loader(corpus, G=8, L=2, D=2, rank=r)
        part.load_state_dict(state)
        part_it = iter(part)
        rows += [next(part_it)["input_ids"], next(part_it)["input_ids"]]
    assert torch.equal(torch.cat(rows), expected)


def test_sources(tmp_path):
    (tmp_path / "one.txt").write_text("x" * 500)
    assert len(token_stream(str(tmp_path / "one.txt"), "text", BYTE).doc_starts) == 1
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("b" * 300)
    (folder / "sub" / "a.jsonl").write_text('{"body": "a1"}\n\n{"body": "a2"}\n')
    (folder / "notes.md").write_text("ignored")
    (folder / "a.txt").write_text("a" * 300)
    stream = token_stream(str(folder), "body", BYTE)
    docs = [BYTE.decode(d.tolist()) for d in np.split(stream.tokens, stream.doc_starts[1:])]
    assert docs == ["a" * 300, "b" * 300, "a1", "a2"]  # sorted by relative path
    assert stream.tokens[0] == BYTE.bos_id and stream.tokens[-1] == BYTE.eos_id
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n\n{"body": "x"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl line 3: no text field 'text'"):
        token_stream(str(tmp_path / "bad.jsonl"), "text", BYTE)


def test_source_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank.jsonl").write_text("\n")
    for path in [tmp_path / "empty", tmp_path / "blank.jsonl"]:
        with pytest.raises(ConfigError, match=f"no documents with text in '{path}'"):
            loader(path)
    with pytest.raises(ConfigError, match="does not exist"):
        loader(tmp_path / "missing.txt")
    (tmp_path / "small.txt").write_text("tiny")
    with pytest.raises(ConfigError, match="only 0 samples of seq_len 16 .* global_batch_size 8"):
        loader(tmp_path / "small.txt")


def test_batch_divisibility(corpus):
    with pytest.raises(ConfigError, match=r"global_batch_size \(12\) must be divisible by "
                                          r"local_batch_size \(4\) x dp degree \(2\)"):
        loader(corpus, G=12, L=4, D=2)


def test_holdout_split_is_disjoint(corpus):
    full = token_stream(str(corpus), "text", BYTE)
    train, val = (split_stream(full, 0.1, s) for s in ("train", "val"))
    assert len(train.tokens) + len(val.tokens) == len(full.tokens)
    assert len(train.tokens) in full.doc_starts and val.tokens[0] == BYTE.bos_id
    assert abs(len(val.tokens) / len(full.tokens) - 0.1) < 0.02
    val_loader = build_dataloader(Data(path=str(corpus), holdout_fraction=0.1), BYTE, seq_len=16,
                                  global_batch_size=8, local_batch_size=8, dp_rank=0, dp_degree=1,
                                  split="val")
    val_rows = {tuple(r.tolist()) for b, _ in zip(val_loader, range(3)) for r in b["input_ids"]}
    train_rows = {tuple(r.tolist()) for b in global_batches(corpus, 20, holdout_fraction=0.1) for r in b[:, :-1]}
    assert val_rows and not val_rows & train_rows


def test_protocol_only_tokenizer(tmp_path):
    class Chars:  # implements only the Tokenizer protocol, no encode_batch
        vocab_size, bos_id, eos_id, pad_id = 1000, 998, 999, None

        def encode(self, text):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(map(chr, ids))

    (tmp_path / "a.txt").write_text("hi")
    assert token_stream(str(tmp_path / "a.txt"), "text", Chars()).tokens.tolist() == [998, 104, 105, 999]


def test_embedded_stdlib():
    stream = token_stream("", "text", BYTE)
    assert len(stream.tokens) > 1_000_000 and len(stream.doc_starts) > 100
    batch = next(iter(build_dataloader(Data(), BYTE, seq_len=256, global_batch_size=8,
                                       local_batch_size=8, dp_rank=0, dp_degree=1)))
    assert batch["input_ids"].shape == (8, 256)
