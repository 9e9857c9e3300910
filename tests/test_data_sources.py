"""Parquet and Hugging Face sources, streaming, weighted mixtures, epochs, vocab check."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from test_data import BYTE, global_batches, hf_folder, write_jsonl  # noqa: F401 (fixture)

from titanlite.config import load as config_load
from titanlite.config.data import Data
from titanlite.errors import ConfigError
from titanlite.data.loader import build_dataloader, build_dataset, mix_schedule, token_stream
from titanlite.config.data import parse_mix
from titanlite.data.sources import read_documents

# the test extra installs these: a missing one must fail, not skip
import datasets  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402


def texts_of(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("src") / "docs.jsonl", 200)


def test_parquet_file_and_folder(docs, tmp_path):
    texts = texts_of(docs)
    (tmp_path / "pq" / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"body": texts[100:], "n": list(range(100))}), tmp_path / "pq" / "sub" / "b.parquet")
    pq.write_table(pa.table({"body": texts[:100]}), tmp_path / "pq" / "a.parquet", row_group_size=7)
    assert read_documents(str(tmp_path / "pq"), "body", "train") == texts
    assert read_documents(str(tmp_path / "pq" / "a.parquet"), "body", "train") == texts[:100]
    with pytest.raises(ConfigError, match=r"b\.parquet has no column 'text' \(columns: body, n\)"):
        read_documents(str(tmp_path / "pq" / "sub" / "b.parquet"), "text", "train")
    with pytest.raises(ConfigError, match=r"b\.parquet column 'n' holds int, not text"):
        read_documents(str(tmp_path / "pq" / "sub" / "b.parquet"), "n", "train")


def test_parquet_without_pyarrow(tmp_path, monkeypatch):
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "a.parquet")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConfigError, match="needs pyarrow; pip install"):
        read_documents(str(tmp_path / "a.parquet"), "text", "train")


def test_hf_save_to_disk(docs, tmp_path):
    texts = texts_of(docs)
    datasets.Dataset.from_dict({"content": texts}).save_to_disk(tmp_path / "ds")
    assert read_documents(str(tmp_path / "ds"), "content", "train") == texts
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"content": texts[:150]}),
                          "test": datasets.Dataset.from_dict({"content": texts[150:]})}
                         ).save_to_disk(tmp_path / "dd")
    assert read_documents(str(tmp_path / "dd"), "content", "test") == texts[150:]
    with pytest.raises(ConfigError, match=r"has no split 'validation' \(splits: train, test\)"):
        read_documents(str(tmp_path / "dd"), "content", "validation")
    with pytest.raises(ConfigError, match=r"ds has no column 'text' \(columns: content\)"):
        read_documents(str(tmp_path / "ds"), "text", "train")
    # The same corpus gives the same batches from jsonl and from a datasets folder
    a = global_batches(docs, 2, G=8, L=4)
    b = global_batches(tmp_path / "ds", 2, G=8, L=4, text_field="content")
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def stream_loader(path, *, G=8, L=2, D=1, rank=0, **cfg):
    return build_dataloader(Data(path=str(path), streaming=True, **cfg), BYTE, seq_len=16,
                            global_batch_size=G, local_batch_size=L, dp_rank=rank, dp_degree=D)


def part_rows(path: Path, part: int, parts: int, first: int, n: int) -> torch.Tensor:
    """Samples first..first+n (seq_len 16 + 1 tokens) of a jsonl source's part `part` of
    `parts` read whole: its every parts-th document, packed."""
    sub = path.parent / f"{path.stem}-part{part}of{parts}.jsonl"
    sub.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts_of(path)[part::parts]))
    tokens = token_stream(str(sub), "text", BYTE).tokens.astype(np.int64)
    return torch.from_numpy(np.stack([tokens[i * 16:i * 16 + 17] for i in range(first, first + n)]))


def test_streaming_parts_pack_their_own_documents(docs):
    """One part (1 rank, no workers) streams the map-style samples; with dp x workers = P parts,
    part p = rank * workers + worker packs documents p, p+P, ... and a rank's micro-batches
    take its workers' parts in turn."""
    ref = global_batches(docs, 4, G=8, L=8, shuffle=False, holdout_fraction=0.0)
    it = iter(stream_loader(docs, G=8, L=8, shuffle=False))
    for step in range(4):
        b = next(it)
        assert torch.equal(torch.cat([b["input_ids"], b["labels"][:, -1:]], 1), ref[step]), step
    for D, W in [(2, 0), (2, 2)]:
        w = max(W, 1)
        for r in range(D):
            it = iter(stream_loader(docs, G=8, L=2, D=D, rank=r, shuffle=False, num_workers=W))
            for m in range(4):
                b = next(it)
                expected = part_rows(docs, r * w + m % w, D * w, 2 * (m // w), 2)
                assert torch.equal(torch.cat([b["input_ids"], b["labels"][:, -1:]], 1), expected), (D, W, r, m)


def test_streaming_reads_the_source_once_per_dp_group(tmp_path):
    from titanlite.data.streaming import StreamingSamples

    (tmp_path / "files").mkdir()
    for k in range(4):  # 4 files: 2 or 4 parts take whole files, 3 parts every 3rd document
        write_jsonl(tmp_path / "files" / f"{k}.jsonl", 10, seed=k)
    texts = [t for k in range(4) for t in texts_of(tmp_path / "files" / f"{k}.jsonl")]
    for D, W, shuffle in [(2, 0, False), (2, 2, True), (3, 0, False), (1, 4, True)]:
        parts = [StreamingSamples(Data(path=str(tmp_path / "files"), shuffle=shuffle, num_workers=W), BYTE,
                                  16, 2, r, D) for r in range(D)]
        w = max(W, 1)
        read = [BYTE.decode(ids.tolist()) for s in parts for p in range(w)
                for ids in s._documents(1, s.dp_rank * w + p)]
        assert sorted(read) == sorted(texts), (D, W)  # each document once, in one part


class CountingBytes(type(BYTE)):
    encoded = 0

    def encode_batch(self, texts):
        CountingBytes.encoded += len(texts)
        return super().encode_batch(texts)


def test_streaming_resumes_without_replaying_and_refuses_another_layout(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", 40)  # rank 1 of 2 streams 20 documents an epoch
    make = lambda D, r=0: build_dataloader(Data(path=str(path), streaming=True), CountingBytes(), seq_len=16,  # noqa: E731
                                           global_batch_size=8, local_batch_size=2, dp_rank=r, dp_degree=D)
    original = make(2, 1)
    it = iter(original)
    for _ in range(600):
        next(it)
    state, expected = original.state_dict(), [next(it)["input_ids"] for _ in range(3)]
    assert state["dataset_state"]["position"]["epoch"] >= 3
    resumed = make(2, 1)
    resumed.load_state_dict(state)
    CountingBytes.encoded = 0
    got = [b["input_ids"] for b, _ in zip(resumed, range(3))]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert CountingBytes.encoded <= 40  # the rest of this epoch and the next one at most, not 3 epochs
    other = make(1)
    other.load_state_dict(state)
    with pytest.raises(ConfigError, match="saved stream position is for dp2_workers1, this run reads the "
                                          "stream as dp1_workers1 .* resume with that dp degree"):
        next(iter(other))
    from titanlite.checkpoint.state import DataState  # a training checkpoint refuses before loading

    saved = {"dataloader.order", "dataloader.stream_dp2_workers1_rank0", "dataloader.stream_dp2_workers1_rank1"}
    DataState(make(2, 1), Data(path=str(path), streaming=True), 16, 8).check_saved(saved)
    with pytest.raises(ConfigError, match="checkpoint holds stream positions for dp2_workers1, this run reads "
                                          "the stream as dp1_workers1"):
        DataState(make(1), Data(path=str(path), streaming=True), 16, 8).check_saved(saved)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_streaming_exact_resume_and_epochs(tmp_path, num_workers):
    path = write_jsonl(tmp_path / "small.jsonl", 30)
    kw = dict(G=8, L=2, D=2, rank=1, num_workers=num_workers, shuffle=True, shuffle_buffer=8)
    original = stream_loader(path, **kw)
    it = iter(original)
    for _ in range(7):
        next(it)
    state = original.state_dict()
    expected = [next(it)["input_ids"] for _ in range(40)]  # past the end of the first epoch
    resumed = stream_loader(path, **kw)
    resumed.load_state_dict(state)
    got = [b["input_ids"] for b, _ in zip(resumed, range(40))]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_streaming_reshuffles_epochs(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", 20)
    from titanlite.data.streaming import StreamingSamples

    def first_docs(shuffle):
        ds = StreamingSamples(Data(path=str(path), shuffle=shuffle, shuffle_buffer=100), BYTE, 16, 8, 0, 1)
        return [BYTE.decode(d.tolist()).split(" ")[1] for e in (0, 1) for d in ds._documents(e)]

    plain, shuffled = first_docs(False), first_docs(True)
    assert plain == [str(i) for i in range(20)] * 2
    assert sorted(shuffled[:20], key=int) == plain[:20] and shuffled[:20] != shuffled[20:]


def test_mix_schedule_and_ratios(tmp_path):
    which, nth = mix_schedule([700, 300])
    assert Counter(which.tolist()) == {0: 700, 1: 300}
    assert max(abs(np.sum(which[:n] == 0) - 0.7 * n) for n in range(1, 1001)) < 1  # evenly spread
    assert all(nth[which == k].tolist() == list(range(c)) for k, c in enumerate([700, 300]))
    a = write_jsonl(tmp_path / "a.jsonl", 150, seed=1)
    (tmp_path / "b").mkdir()
    for i in range(30):
        (tmp_path / "b" / f"{i:02d}.txt").write_text(f"file {i} " + "#" * 90)
    mix = [f"{a}:0.7", f"{tmp_path / 'b'}:0.3"]
    ds = build_dataset(Data(mix=mix, holdout_fraction=0.0), BYTE, 16)
    rows = [ds[g]["input_ids"] for g in range(2000)]
    from_b = [bool((r == ord("#")).sum() > 4 or b"file" in bytes(r[r < 256].tolist())) for r in rows]
    assert sum(from_b) == 600  # 0.3 of every 1000 samples exactly
    assert [ds.locate(g)[0] for g in range(2000)] == [int(x) for x in from_b]
    assert ds.epoch(0) == 0 and ds.epoch(2000) == max(p.epoch(n) for p, n in zip(ds.parts, [1400, 600]))
    assert ds.epoch(2000) >= 1  # b has fewer than 600 samples: it has looped


@pytest.mark.parametrize("num_workers", [0, 2])
def test_mix_layout_independent_and_resumable(tmp_path, num_workers):
    a, b = write_jsonl(tmp_path / "a.jsonl", 100, seed=1), write_jsonl(tmp_path / "b.jsonl", 100, seed=2)
    mix = [f"{a}:2", f"{b}:1"]
    single = iter(mix_loader(mix, G=8, L=8))
    base = [next(single)["input_ids"] for _ in range(4)]
    for D, L in [(2, 2), (4, 1)]:
        its = [iter(mix_loader(mix, G=8, L=L, D=D, rank=r)) for r in range(D)]
        for step in range(4):
            got = torch.cat([next(it)["input_ids"] for it in its for _ in range(8 // (L * D))])
            assert torch.equal(got, base[step]), (D, L, step)
    original = mix_loader(mix, G=8, L=2, D=2, rank=0, num_workers=num_workers)
    it = iter(original)
    next(it), next(it), next(it)
    state = original.state_dict()
    expected = [next(it)["input_ids"] for _ in range(5)]
    resumed = mix_loader(mix, G=8, L=2, D=2, rank=0, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert all(torch.equal(x["input_ids"], y) for (x, _), y in zip(zip(resumed, range(5)), expected))


def mix_loader(mix, *, G, L, D=1, rank=0, num_workers=0):
    return build_dataloader(Data(mix=mix, num_workers=num_workers), BYTE, seq_len=16, global_batch_size=G, local_batch_size=L,
                            dp_rank=rank, dp_degree=D)


@pytest.mark.parametrize("spec,error", [
    (["a.jsonl:0.5"], "at least two"),
    (["a.jsonl:0.5", "b.jsonl"], "'b.jsonl' must be SOURCE:WEIGHT"),
    (["a.jsonl:0.5", "b.jsonl:-1"], "weight > 0"),
    (["a.jsonl:0.5", "a.jsonl:1"], "appears twice"),
    (["hf:wikitext:wikitext-2-raw-v1", "b.jsonl:1"], "'hf:wikitext:wikitext-2-raw-v1' must be"),
])
def test_mix_spec_errors(spec, error):
    with pytest.raises(ConfigError, match=error):
        parse_mix(spec)


def test_config_errors(tmp_path, docs):
    for argv, error in [
        (["--data.mix", f"{docs}:1,{tmp_path}/nope.jsonl:1"], r"data.mix: '.*nope.jsonl' does not exist"),
        (["--data.mix", f"{docs}:1,{docs}x:1", "--data.path", str(docs)], "both set"),
        (["--data.mix", f"{docs}:1000,{tmp_path}:0.1"], None),
        (["--validation.freq", "5", "--data.holdout_fraction", "0"], "no validation data"),
        (["--validation.freq", "5", "--data.streaming", "--data.path", str(docs)], "needs validation.path"),
        (["--data.streaming"], "data.streaming needs data.path"),
    ]:
        if error is None:
            with pytest.raises(ConfigError, match="below 1/1000"):
                build_dataset(config_load.load(argv)[0].data, BYTE, 16)
        else:
            with pytest.raises(ConfigError, match=error):
                config_load.load(argv)


def test_empty_sources(tmp_path):
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "e.parquet")
    datasets.Dataset.from_dict({"text": ["", ""]}).save_to_disk(tmp_path / "eds")
    for path in [tmp_path / "e.parquet", tmp_path / "eds"]:
        with pytest.raises(ConfigError, match=f"no documents with text in '{path}'"):
            token_stream(str(path), "text", BYTE)
    with pytest.raises(ConfigError, match="no documents with text"):
        next(iter(stream_loader(tmp_path / "eds")))


def test_vocab_check(hf_folder):  # noqa: F811
    from titanlite.data.tokenizer import build_tokenizer
    from titanlite.preflight import preflight

    n = build_tokenizer(str(hf_folder)).vocab_size
    assert 256 < n <= 512  # the debug model embeds 512 rows
    cfg, _ = config_load.load(["--data.tokenizer", str(hf_folder), "--model.vocab_size", "256"])
    with pytest.raises(ConfigError, match=f"has {n} ids but the model embeds only 256; "
                                          f"set model.vocab_size >= {n}"):
        preflight(cfg, 1)
    assert preflight(config_load.load(["--data.tokenizer", str(hf_folder)])[0], 1).args.vocab_size >= n


RESUME_SCRIPT = """
import json, sys, torch
from titanlite.config.data import Data
from titanlite.data.loader import build_dataloader
from titanlite.data.tokenizer import ByteTokenizer
cfg, state_file, out = Data(**json.loads(sys.argv[1])), sys.argv[2], sys.argv[3]
loader = build_dataloader(cfg, ByteTokenizer(), seq_len=16, global_batch_size=8, local_batch_size=2,
                          dp_rank=1, dp_degree=2)
loader.load_state_dict(torch.load(state_file, weights_only=False))
torch.save([b["input_ids"] for b, _ in zip(loader, range(6))], out)
"""


@pytest.mark.parametrize("kind,num_workers", [("mix", 2), ("streaming", 0)])
def test_resume_in_a_new_process(tmp_path, kind, num_workers):
    a, b = write_jsonl(tmp_path / "a.jsonl", 60, seed=1), write_jsonl(tmp_path / "b.jsonl", 60, seed=2)
    cfg = ({"mix": [f"{a}:3", f"{b}:1"]} if kind == "mix" else {"path": str(a), "streaming": True})
    cfg["num_workers"] = num_workers
    original = build_dataloader(Data(**cfg), BYTE, seq_len=16, global_batch_size=8, local_batch_size=2,
                                dp_rank=1, dp_degree=2)
    it = iter(original)
    for _ in range(9):
        next(it)
    torch.save(original.state_dict(), tmp_path / "state.pt")
    expected = [next(it)["input_ids"] for _ in range(6)]
    repo = str(Path(__file__).resolve().parent.parent)
    subprocess.run([sys.executable, "-c", RESUME_SCRIPT, json.dumps(cfg), str(tmp_path / "state.pt"),
                    str(tmp_path / "out.pt")], check=True, cwd=repo,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo})
    got = torch.load(tmp_path / "out.pt")
    assert len(got) == 6 and all(torch.equal(x, y) for x, y in zip(expected, got))


def test_bad_sources_fail_at_check_with_one_line(tmp_path, docs):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(tmp_path / "dd")
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    repo = str(Path(__file__).resolve().parent.parent)
    for args, line in [
        (["--data.path", str(tmp_path / "a.parquet")], f"data.path: {tmp_path / 'a.parquet'} has no column 'text' "
                                                      "(columns: body); set data.text_field"),
        (["--data.mix", f"{docs}:1,{tmp_path / 'bad.jsonl'}:1"], f"data.path: {tmp_path / 'bad.jsonl'} line 1: "
                                                                "no text field 'text'"),
        (["--validation.freq", "2", "--validation.path", str(tmp_path / "dd")],
         f"data.split: '{tmp_path / 'dd'}' has no split 'validation' (splits: train)"),
    ]:
        proc = subprocess.run([sys.executable, "-m", "titanlite.train", "--check", *args], capture_output=True,
                              text=True, cwd=repo, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo},
                              timeout=120)
        assert proc.returncode == 2 and proc.stdout == "", (args, proc.stdout, proc.stderr)
        assert proc.stderr.startswith("titanlite: error: ") and proc.stderr.count("\n") == 1, proc.stderr
        assert line in proc.stderr, (line, proc.stderr)


def test_validation_reads_each_sample_at_most_once(docs):
    from titanlite.config.data import Validation
    from titanlite.data.validation import Validator

    data = Data(path=str(docs), holdout_fraction=0.2)
    n = build_dataset(data, BYTE, 16, "val").num_samples
    assert Validator(Validation(freq=1, steps=n // 8), data, BYTE, 16, 8, 4, 0, 1, None).loader is not None
    with pytest.raises(ConfigError, match=f"validation.steps {n // 8 + 1} x global batch 8 is more than the {n}"):
        Validator(Validation(freq=1, steps=n // 8 + 1), data, BYTE, 16, 8, 4, 0, 1, None)


def test_every_source_kind_gives_the_same_batches(tmp_path):
    texts = [f"document {i}\n" + "line ✓ \n" * (i % 7) for i in range(60)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(tmp_path / "ds")
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"text": texts[:25]}), tmp_path / "pq" / "a.parquet")
    pq.write_table(pa.table({"text": texts[25:]}), tmp_path / "pq" / "b.parquet")
    (tmp_path / "tx").mkdir()
    for i, text in enumerate(texts):
        (tmp_path / "tx" / f"{i:03d}.txt").write_text(text)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))

    def batches(path, streaming):
        it = iter(build_dataloader(Data(path=str(path), streaming=streaming, shuffle=False, holdout_fraction=0.0),
                                   BYTE, seq_len=16, global_batch_size=8, local_batch_size=8, dp_rank=0, dp_degree=1))
        return torch.cat([next(it)["input_ids"] for _ in range(4)])

    ref = batches(tmp_path / "docs.jsonl", False)
    assert ref[0, 0] == BYTE.bos_id and BYTE.decode(ref[0, 1:12].tolist()) == texts[0]
    assert ref[0, 12] == BYTE.eos_id and ref[0, 13] == BYTE.bos_id
    for kind in ["ds", "pq", "tx", "docs.jsonl"]:
        for streaming in (False, True):
            assert torch.equal(batches(tmp_path / kind, streaming), ref), (kind, streaming)


@pytest.mark.parametrize("streaming", [False, True])
def test_validation_reads_the_same_batches_every_time(docs, streaming):
    from titanlite.config.data import Validation
    from titanlite.data.validation import Validator

    v = Validator(Validation(freq=1, steps=3, path=str(docs)), Data(path=str(docs), streaming=streaming),
                  BYTE, 16, 8, 2, 1, 2, None)
    runs = []
    for _ in range(2):
        v.loader.load_state_dict(v.start)
        runs.append(torch.cat([b["input_ids"] for b, _ in zip(v.loader, range(6))]))
    assert torch.equal(runs[0], runs[1])
    if streaming:  # rank 1 of 2 streams its own part: every 2nd document from the second on
        assert torch.equal(runs[0], part_rows(docs, 1, 2, 0, 12)[:, :-1])
    else:  # rank 1 of 2, in order
        unshuffled = global_batches(docs, 3, G=8, L=8, shuffle=False, holdout_fraction=0.0)
        assert torch.equal(runs[0], torch.cat([b[4:, :-1] for b in unshuffled]))
