"""Tokenizers: a built-in byte tokenizer, its chat twin and a wrapper around local Hugging Face
tokenizer files.

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


CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
"""byte_chat's ids 259 and 260, after the byte tokenizer's 256 bytes, BOS, EOS and pad."""
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}"
    "{% if m.content %}{{ m.content }}{% endif %}{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}"
    "<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML turns; {% generation %} marks what an assistant turn writes (its text, its tool calls,
the end of its turn and the line break after it, so the spans are those that rendering each
prefix finds too)."""


def _byte_chars() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte, which a byte-level BPE stores."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(moved)}}


def byte_chat_tokenizer() -> HFTokenizer:
    """data.tokenizer = "byte_chat": the byte tokenizer's ids (every byte its own id, BOS 256, EOS
    257, pad 258, so a model pre-trained on "byte" fine-tunes with it unchanged) as a Hugging Face
    fast tokenizer with a ChatML chat template and two turn markers (ids 259, 260). Like any HF
    tokenizer it reads its special tokens spelled out in text ("<s>", "<|im_end|>") as those tokens.
    Built here in a millisecond rather than shipped as files; `.hf.save_pretrained(folder)` writes
    it as one."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast

    rust = RustTokenizer(models.BPE(vocab={c: b for b, c in _byte_chars().items()}, merges=[]))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    rust.decoder = decoders.ByteLevel()
    rust.add_special_tokens([AddedToken(t, special=True, normalized=False)
                             for t in ("<s>", "</s>", "<pad>", *CHAT_TOKENS)])
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                 chat_template=BYTE_CHAT_TEMPLATE, model_max_length=2**62)
    return HFTokenizer(hf, "byte_chat")


def build_tokenizer(spec: str) -> Tokenizer:
    """`"byte"` for the built-in byte tokenizer, `"byte_chat"` for its chat twin, else a folder of
    Hugging Face tokenizer files."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "byte_chat":
        return byte_chat_tokenizer()
    folder = Path(spec)
    if not folder.is_dir():
        raise ConfigError(f"data.tokenizer: '{spec}' is not 'byte', 'byte_chat' or a folder")
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
