"""Tokenizers: a built-in byte tokenizer and a wrapper around local Hugging Face tokenizer files.

Besides the `Tokenizer` protocol, both implementations offer `encode_batch(texts)`, which
the data pipeline uses to tokenize a whole corpus at once (numpy for bytes, the Rust batch
encoder for fast HF tokenizers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import numpy as np

from titanlite.errors import ConfigError

# Any of these in a folder means AutoTokenizer has something to load.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt",
                    "merges.txt", "tokenizer.model", "spiece.model")


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS."""
        ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; three special ids follow. All instances are equal, so
    they share cached token streams."""

    vocab_size: ClassVar[int] = 259
    bos_id: ClassVar[int] = 256
    eos_id: ClassVar[int] = 257
    pad_id: ClassVar[int | None] = 258

    def encode(self, text: str) -> list[int]:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).tolist()

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: list[int]) -> str:
        """Special ids (and ids past the byte range, e.g. from a padded embedding) are dropped."""
        arr = np.asarray(ids, dtype=np.int64)
        arr = arr[(arr >= 0) & (arr < 256)]
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local folder.

    Tokenizers without a BOS token (GPT-2 style) separate documents with EOS only: then
    `bos_id == eos_id` and the data pipeline writes `tokens + [EOS]` per document.
    """

    def __init__(self, tok, folder: str) -> None:
        bos, eos = tok.bos_token_id, tok.eos_token_id
        if bos is None and eos is None:
            raise ConfigError(f"data.tokenizer: '{folder}' defines neither a BOS nor an EOS "
                              "token; set eos_token in its tokenizer_config.json")
        self.hf = tok  # the transformers tokenizer (its rules fingerprint token folders)
        self.vocab_size = len(tok)
        self.eos_id = eos if eos is not None else bos
        self.bos_id = bos if bos is not None else self.eos_id
        self.pad_id = tok.pad_token_id

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False, verbose=False)

    def encode_batch(self, texts: list[str], chunk: int = 256) -> list[np.ndarray]:
        out = []
        for i in range(0, len(texts), chunk):
            # verbose=False: documents longer than the model's max length are expected here.
            enc = self.hf(texts[i:i + chunk], add_special_tokens=False,
                            return_attention_mask=False, verbose=False)
            out += [np.asarray(ids, dtype=np.uint32) for ids in enc["input_ids"]]
        return out

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids)


def build_tokenizer(spec: str) -> Tokenizer:
    """`"byte"` for the built-in byte tokenizer, else a folder of Hugging Face tokenizer files."""
    if spec == "byte":
        return ByteTokenizer()
    folder = Path(spec)
    if not folder.is_dir():
        raise ConfigError(f"data.tokenizer: '{spec}' is neither 'byte' nor a folder")
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ConfigError(f"data.tokenizer: '{spec}' has no tokenizer files (tokenizer.json or "
                          "tokenizer_config.json); save one there with "
                          "tokenizer.save_pretrained(folder) or use data.tokenizer = 'byte'")
    from transformers import AutoTokenizer  # imported here: it takes seconds

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.tokenizer: cannot load '{spec}': {e}") from None
    return HFTokenizer(tok, spec)
