"""Chats: rows of OpenAI-style messages, checked, rendered with the tokenizer's own chat template and
marked with the tokens the loss is on.

A chat becomes (ids, targets): the token ids transformers' `apply_chat_template` gives, and a flag
per token saying whether it is a target (`data.train_on`). Packing (titanlite.data.packing) turns
token i of a chat into the label of position i - 1, so the flags are never shifted here. Where the
template marks what an assistant writes with {% generation %}, the flags are transformers' own
`return_assistant_tokens_mask`. Elsewhere an assistant turn is the text between rendering the chat
up to it with the generation prompt and rendering it up to and including it, each of which must
begin the whole chat's rendering: a template that renders an earlier turn differently once later
turns follow (one that drops an earlier turn's reasoning) is refused, not masked wrong. Either way
a token is a target where any of its characters falls in an assistant span, as transformers decides.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import numpy as np

from titanlite.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_CHUNK = 256  # chats per template and tokenizer call
Chat = tuple[np.ndarray, np.ndarray]
"""(token ids as uint32, target flags as bool), one entry per token."""


def _has_text(content: object) -> bool:
    if isinstance(content, str):
        return bool(content.strip())
    return isinstance(content, list) and any(isinstance(p, dict) and _has_text(p.get("text")) for p in content)


def check_messages(value: object, where: str, field: str) -> list[dict]:
    """A row's messages as the template gets them (keys holding None dropped, as transformers
    does), or one line naming the row and what is wrong with it."""
    if not isinstance(value, list) or not value:
        what = (f"no '{field}'" if value is None else f"'{field}' is an empty list" if isinstance(value, list) else
                f"'{field}' is a {type(value).__name__}")
        raise ConfigError(f"data.path: {where}: {what}, not a list of messages; set data.messages_field to the "
                          "field that holds each chat, or drop the row")
    out = []
    for n, m in enumerate(value, 1):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            got = f"role {role!r}" if isinstance(m, dict) else f"a {type(m).__name__}, not a message"
            raise ConfigError(f"data.path: {where}: message {n} has {got}; each message needs a role among "
                              f"{', '.join(ROLES)}")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ConfigError(f"data.path: {where}: message {n} ({role}) has content of type "
                              f"{type(content).__name__}; content is text or a list of parts")
        if role == "assistant" and not _has_text(content) and not m.get("tool_calls"):
            raise ConfigError(f"data.path: {where}: message {n} is an empty assistant turn (no content, no "
                              "tool_calls); there is nothing to learn from it: fill it in or drop the row")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def check_template(tokenizer, name: str) -> None:
    """The tokenizer can render chats and report where each token came from."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None or not getattr(hf, "chat_template", None):
        raise ConfigError(f"data.tokenizer '{name}' has no chat template; data.format chat renders each chat with "
                          "it: use a tokenizer folder whose tokenizer_config.json (or chat_template.jinja) has "
                          "one, or data.tokenizer = 'byte_chat'")
    if not hf.is_fast:
        raise ConfigError(f"data.tokenizer '{name}' is a slow (Python) tokenizer, which cannot say which "
                          "characters each token covers; save it with its tokenizer.json (a fast tokenizer)")


def _render(hf, chats: list[list[dict]], prompt: bool = False) -> list[str]:
    return hf.apply_chat_template(chats, tokenize=False, add_generation_prompt=prompt)


def _flags(offsets: Iterable[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """A token is a target where it overlaps a span (transformers' rule); spans in order."""
    offsets = list(offsets)
    out, k = np.zeros(len(offsets), dtype=bool), 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        out[i] = end > spans[k][0]
    return out


def _turn_spans(hf, chat: list[dict], turns: list[int], text: str, where: str) -> list[tuple[int, int]]:
    """Each turn's characters in `text` (the whole chat rendered): from the end of the chat up to
    it with the generation prompt to the end of the chat up to and including it."""
    spans = []
    for k in turns:
        if k == 0:
            raise ConfigError(f"data.path: {where}: the chat opens with an assistant turn, and the chat template "
                              "marks no {% generation %} spans, so where that turn starts cannot be told from the "
                              "template; begin the chat with a system or user message")
        before, through = _render(hf, [chat[:k]], prompt=True)[0], _render(hf, [chat[:k + 1]])[0]
        if not (through.startswith(before) and text.startswith(through)):
            raise ConfigError(f"data.path: {where}: the chat template renders message {k + 1} (assistant) "
                              "differently once later messages follow (it rewrites earlier turns), so its tokens "
                              "cannot be told from rendering each prefix; mark what the assistant writes with "
                              "{% generation %} ... {% endgeneration %} in the template, or use data.train_on last")
        spans.append((len(before), len(through)))
    return spans


def _render_chunk(hf, chats: list[list[dict]], wheres: list[str], train_on: str) -> list[Chat]:
    texts = _render(hf, chats)
    assistant = [[k for k, m in enumerate(c) if m["role"] == "assistant"] for c in chats]
    turns = [a[-1:] if train_on == "last" else a for a in assistant]
    if train_on != "all" and _GENERATION.search(hf.get_chat_template()):
        enc = hf.apply_chat_template(chats, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                     tokenizer_kwargs={"verbose": False})
        flags = [np.asarray(m, dtype=bool) for m in enc["assistant_masks"]]
        if train_on == "last":  # the generation spans after the last assistant turn's prompt
            for i, (chat, t) in enumerate(zip(chats, turns)):
                start = (len(texts[i]) if not t else 0 if t == [0] else
                         _turn_spans(hf, chat, t, texts[i], wheres[i])[0][0])
                flags[i] &= np.array([s >= start for s, _ in enc.encodings[i].offsets], dtype=bool)
        ids = enc["input_ids"]
    else:
        enc = hf(texts, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        ids = enc["input_ids"]
        flags = [np.ones(len(x), dtype=bool) if train_on == "all" else
                 _flags(off, _turn_spans(hf, chat, t, text, where))
                 for x, off, chat, t, text, where in zip(ids, enc["offset_mapping"], chats, turns, texts, wheres)]
    out = []
    for x, f, where in zip(ids, flags, wheres):
        if not f[1:].any():  # the first token is never a target: nothing comes before it
            raise ConfigError(f"data.path: {where}: no token to train on with data.train_on = {train_on} (no "
                              "assistant turn the template renders); add one, drop the row or set data.train_on")
        out.append((np.asarray(x, dtype=np.uint32), f))
    return out


def render_chats(tokenizer, name: str, rows: Iterator[tuple[str, object]], field: str, train_on: str
                 ) -> list[Chat]:
    """Every row of `rows` ((where, messages) pairs) checked, rendered and flagged."""
    check_template(tokenizer, name)
    hf, out, chunk = tokenizer.hf, [], []
    for where, value in rows:
        chunk.append((where, check_messages(value, where, field)))
        if len(chunk) == _CHUNK:
            out += _render_chunk(hf, [c for _, c in chunk], [w for w, _ in chunk], train_on)
            chunk = []
    if chunk:
        out += _render_chunk(hf, [c for _, c in chunk], [w for w, _ in chunk], train_on)
    return out
