"""Document sources: where the text comes from, as a list (or, streaming, an iterator) of strings.

A source string is one of
  ""                    the running interpreter's standard-library sources (built in)
  a file or folder      .txt (one document per file), .jsonl (one per line), .parquet (one per row)
  a `save_to_disk` folder   a Hugging Face `datasets` Dataset or DatasetDict
  "hf:NAME[:CONFIG]"    a Hugging Face data set loaded with `datasets.load_dataset`
  a token folder        a corpus tokenized once by titanlite.tools.tokenize (read in tokens.py)
Every order here is fixed by the source alone: files sorted by relative path, rows in file order.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from titanlite.config.data import check_source
from titanlite.errors import ConfigError

STDLIB_MAX_CHARS = 16_000_000  # keeps start-up around a second with the byte tokenizer
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")
_HF_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
TOKEN_INDEX = "index.json"  # a token folder's index (titanlite/data/tokens.py)


def source_name(path: str) -> str:
    return f"'{path}'" if path else f"the Python standard library ({sysconfig.get_paths()['stdlib']})"




def stdlib_files() -> list[tuple[str, str]]:
    """(path relative to the standard library's folder, text) of the running interpreter's own
    standard-library sources, minus tests and packages, sorted by path, the first 16 MB."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _STDLIB_SKIP_DIRS]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    out, total = [], 0
    for f in files:
        if total >= STDLIB_MAX_CHARS:
            break
        out.append((f.relative_to(root).as_posix(), f.read_text(encoding="utf-8", errors="replace")))
        total += len(out[-1][1])
    return out


def _stdlib_documents() -> list[str]:
    return [text for _, text in stdlib_files()]


def jsonl_rows(path: Path, key: str = "data.path") -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of each non-blank line; `key`: the setting an error line names."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{key}: {path} line {lineno}: invalid JSON ({e}); fix or drop the line") from None


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    for lineno, record in jsonl_rows(path):
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise ConfigError(f"data.path: {path} line {lineno}: no text field '{field}'; "
                              "set data.text_field to the field holding the text")
        yield record[field]


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("data.path: reading .parquet files needs pyarrow; "
                          "pip install 'titanlite[data]' (or pip install pyarrow)") from None
    return pq


def _parquet_column(path: Path, field: str, key: str = "data.text_field") -> Iterator[object]:
    """The values of one column, row by row; `key` is the setting that names it."""
    pq = _pyarrow_parquet()
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise ConfigError(f"data.path: {path}: not a readable parquet file ({e})") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise ConfigError(f"data.path: {path} has no column '{field}' (columns: {', '.join(names)}); "
                          f"set {key} to the column that holds it")
    for batch in pf.iter_batches(columns=[field], batch_size=4096):
        yield from batch.column(0).to_pylist()


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    for text in _parquet_column(path, field):
        if text is not None and not isinstance(text, str):
            raise ConfigError(f"data.path: {path} column '{field}' holds {type(text).__name__}, "
                              "not text; set data.text_field to a string column")
        yield text or ""


def _file_documents(path: Path, field: str) -> Iterator[str]:
    if path.suffix == ".jsonl":
        yield from _jsonl_documents(path, field)
    elif path.suffix == ".parquet":
        yield from _parquet_documents(path, field)
    else:
        yield path.read_text(encoding="utf-8", errors="replace")


def _files(p: Path) -> list[Path]:
    if p.is_dir():
        return sorted((f for f in p.rglob("*") if f.suffix in FILE_SUFFIXES and f.is_file()),
                      key=lambda f: f.relative_to(p).as_posix())
    if p.suffix in FILE_SUFFIXES:
        return [p]
    raise ConfigError(f"data.path: '{p}' must be a .txt, .jsonl or .parquet file, a folder of them, "
                      "a datasets save_to_disk folder or hf:NAME")


def _is_hf_disk(p: Path) -> bool:
    return p.is_dir() and any((p / m).is_file() for m in _HF_DISK_MARKERS)


def is_token_folder(path: str) -> bool:
    """A folder written by titanlite.tools.tokenize, finished or not (shards come before the index)."""
    p = Path(path)
    return bool(path) and p.is_dir() and ((p / TOKEN_INDEX).is_file() or any(p.glob("tokens-*.bin")))


def unread_keys(path: str) -> set[str]:
    """The data keys a source never reads: `split` and `text_field` of a token folder or the
    embedded source, `split` of local files (and `text_field` where they are all .txt)."""
    if not path or is_token_folder(path):
        return {"split", "text_field"}
    if path.startswith("hf:") or _is_hf_disk(Path(path)):
        return set()
    return {"split"} | ({"text_field"} if all(f.suffix == ".txt" for f in _files(Path(path))) else set())


def _check_column(ds, path: str, field: str) -> None:
    names = ds.column_names
    if names is not None and field not in names:  # None: a streamed source whose schema is unknown yet
        raise ConfigError(f"data.path: {path} has no column '{field}' (columns: {', '.join(names)}); "
                          "set data.text_field to the column holding the text")


def _hf_dataset(path: str, split: str, streaming: bool):
    """A `datasets` Dataset (or IterableDataset when streaming) for an HF source or local files."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"data.path: '{path}' needs the datasets package; "
                          "pip install 'titanlite[data]' (or pip install datasets)") from None
    datasets.disable_progress_bars()
    p = Path(path)
    if path.startswith("hf:"):
        name, _, subset = path[3:].partition(":")
        try:
            return datasets.load_dataset(name, subset or None, split=split, streaming=streaming)
        except (FileNotFoundError, ValueError, OSError) as e:
            raise ConfigError(f"data.path: cannot load '{path}' split '{split}': {e}") from None
    if _is_hf_disk(p):
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ConfigError(f"data.split: '{path}' has no split '{split}' "
                                  f"(splits: {', '.join(ds)})")
            ds = ds[split]
        return ds.to_iterable_dataset() if streaming else ds
    files = _files(p)
    if not files:
        raise ConfigError(f"data.path: no .txt, .jsonl or .parquet files in '{path}'")
    suffixes = {f.suffix for f in files}
    if len(suffixes) > 1:
        raise ConfigError(f"data.path: streaming '{path}' needs files of one kind, found "
                          f"{', '.join(sorted(suffixes))}; split them into a data.mix")
    builder = {".txt": "text", ".jsonl": "json", ".parquet": "parquet"}[suffixes.pop()]
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                 streaming=streaming, **kwargs)


def iter_documents(path: str, field: str, split: str) -> Iterator[str]:
    """All documents of a source, in the source's own order, read as they are needed."""
    if not path:
        yield from _stdlib_documents()
        return
    p = Path(path)
    if is_token_folder(path):
        raise ConfigError(f"data.path: '{path}' is a token folder, already tokenized; train from it as it is")
    if path.startswith("hf:") or _is_hf_disk(p):
        ds = _hf_dataset(path, split, streaming=False)
        _check_column(ds, path, field)
        for batch in ds.iter(batch_size=1024):
            yield from (t or "" for t in batch[field])
        return
    if not p.exists():
        raise ConfigError(f"data.path: '{path}' does not exist")
    for f in _files(p):
        yield from _file_documents(f, field)


def iter_records(path: str, field: str, split: str, key: str) -> Iterator[tuple[str, object]]:
    """(where, value) of field `field` of every row of a .jsonl or .parquet source or a data set, in
    the source's own order; `where` names the row for an error line, `key` the setting naming the field."""
    p = Path(path)
    if is_token_folder(path):
        raise ConfigError(f"data.path: '{path}' is a token folder, which holds tokens, not {field} rows")
    if path.startswith("hf:") or _is_hf_disk(p):
        ds = _hf_dataset(path, split, streaming=False)
        if field not in ds.column_names:
            raise ConfigError(f"data.path: {path} has no column '{field}' (columns: {', '.join(ds.column_names)}); "
                              f"set {key} to the column that holds it")
        for n, value in enumerate(v for batch in ds.iter(batch_size=1024) for v in batch[field]):
            yield f"{path} row {n + 1}", value
        return
    if not p.exists():
        raise ConfigError(f"data.path: '{path}' does not exist")
    for f in _files(p):
        if f.suffix == ".jsonl":
            for lineno, record in jsonl_rows(f):
                yield f"{f} line {lineno}", record.get(field) if isinstance(record, dict) else None
        elif f.suffix == ".parquet":
            yield from ((f"{f} row {n + 1}", v) for n, v in enumerate(_parquet_column(f, field, key)))
        else:
            raise ConfigError(f"data.path: {f}: {field} rows come from .jsonl or .parquet files or a data set, "
                              "not .txt")


def read_documents(path: str, field: str, split: str) -> list[str]:
    """All documents of a source, in the source's own order."""
    return list(iter_documents(path, field, split))


def stream_documents(path: str, field: str, split: str, seed: int, shuffle: bool, epoch: int,
                     buffer_size: int, part: int = 0, parts: int = 1) -> Iterator[str]:
    """One pass over part `part` of `parts` of a source without reading it whole (whole files or
    shards when `parts` divides their count, else every parts-th document); shuffled within a
    buffer by (seed, epoch)."""
    if not path:
        raise ConfigError("data.streaming needs data.path; the embedded source is read whole")
    if is_token_folder(path):
        raise ConfigError(f"data.streaming: '{path}' is a token folder, read by index without "
                          "streaming; set data.streaming = false")
    if not (path.startswith("hf:") or Path(path).exists()):
        raise ConfigError(f"data.path: '{path}' does not exist")
    ds = _hf_dataset(path, split, streaming=True)
    _check_column(ds, path, field)
    if parts > 1:
        from datasets.distributed import split_dataset_by_node

        ds = split_dataset_by_node(ds, rank=part, world_size=parts)
    if shuffle:
        ds = ds.shuffle(seed=seed, buffer_size=buffer_size)
        ds.set_epoch(epoch)
    # .iter() reads every shard of this part even inside a DataLoader worker (plain iteration
    # would split them again across the workers)
    for n, batch in enumerate(ds.iter(batch_size=256)):
        texts = batch.get(field)
        bad = texts is None or any(t is not None and not isinstance(t, str) for t in texts)
        if bad:
            raise ConfigError(f"data.path: {path} records {256 * n + 1}-{256 * (n + 1)} have no text "
                              f"field '{field}'; set data.text_field to the field holding the text")
        yield from (t or "" for t in texts)


def source_bytes(path: str) -> float:
    """Size of a source's files; infinite for sources of unknown size (Hugging Face data sets)."""
    if not path:
        return STDLIB_MAX_CHARS
    p = Path(path)
    if is_token_folder(path):
        return 0  # opened without being read
    if path.startswith("hf:") or _is_hf_disk(p):
        return float("inf")
    return sum(f.stat().st_size for f in _files(p))


def check_text(path: str, field: str, key: str = "data.path") -> None:
    """Refuse a local source without a single non-empty document, reading only up to the first."""
    if not path or path.startswith("hf:") or _is_hf_disk(Path(path)) or is_token_folder(path):
        return  # the built-in source has text; a data set's column and a token folder were probed
    if not any(doc for f in _files(Path(path)) for doc in _file_documents(f, field)):
        raise ConfigError(f"{key}: no documents with text in '{path}'; every document is empty")




def probe_source(path: str, field: str, split: str) -> None:
    """Cheap pre-start check that a source can be read: files exist, columns and splits are
    there (parquet schemas, the first jsonl record, save_to_disk metadata). Remote hf: data
    sets are only checked when loaded."""
    if not path or path.startswith("hf:"):
        return
    p = Path(path)
    if _is_hf_disk(p):
        _check_column(_hf_dataset(path, split, streaming=False), path, field)
        return
    check_source(path)
    files = _files(p)
    if not files:
        raise ConfigError(f"data.path: no .txt, .jsonl or .parquet files in '{path}'")
    for f in files:
        if f.suffix == ".parquet":
            names = _pyarrow_parquet().read_schema(f).names
            if field not in names:
                raise ConfigError(f"data.path: {f} has no column '{field}' (columns: {', '.join(names)}); "
                                  "set data.text_field to the column holding the text")
        elif f.suffix == ".jsonl":
            next(_jsonl_documents(f, field), None)
