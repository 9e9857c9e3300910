"""Chat data (data.format chat), in process: the tokens and target masks transformers makes, labels
that are the next token exactly where it is a target (checked against the text each assistant turn
writes, built here from the messages alone), packing, the packed loss against each chat run alone,
the layout-independent order and its resume, and bad rows refused in one line."""

import dataclasses
import json
import re

import numpy as np
import pytest
import torch

from titanlite.config.data import Data
from titanlite.data.chat import render_chats
from titanlite.data.chat_set import stdlib_chats
from titanlite.data.loader import build_dataloader
from titanlite.data.packing import ChatSamples, pack, read_chats
from titanlite.data.tokenizer import BYTE_CHAT_TEMPLATE, ByteTokenizer, build_tokenizer
from titanlite.errors import ConfigError
from titanlite.layers.attention import AttnContext
from titanlite.loss import IGNORE_INDEX, cross_entropy_sum
from titanlite.models.llama3 import flavors
from titanlite.models.llama3.model import Transformer

END = "<|im_end|>\n"
CALL = [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]
CHATS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
     {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3 × 3?"},
     {"role": "assistant", "content": "9 ✓"}],
    # a tool call without text, the tool's answer, and a last user turn that nothing answers
    [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": CALL},
     {"role": "tool", "content": "sunny, 21 °C"}, {"role": "assistant", "content": "Sunny, 21 °C."},
     {"role": "user", "content": "Thanks"}],
    [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"}],
]
# What each assistant turn writes, from the messages alone (the tool call as the template's tojson writes it)
WRITES = [["4." + END, "9 ✓" + END],
          ['[{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]' + END,
           "Sunny, 21 °C." + END],
          ["7" + END]]
PLAIN = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", BYTE_CHAT_TEMPLATE)  # no spans: prefixes decide


def tokenizer(template: str | None = BYTE_CHAT_TEMPLATE):
    tok = build_tokenizer("byte_chat")
    tok.hf.chat_template = template
    return tok


def render(tok, chats, train_on="assistant"):
    return render_chats(tok, "byte_chat", iter((f"row {i + 1}", c) for i, c in enumerate(chats)), "messages", train_on)


def expected(writes: list[str], train_on: str) -> str:
    return "".join(writes[-1:] if train_on == "last" else writes)


def test_byte_chat_is_the_byte_tokenizer_with_a_template(tmp_path):
    tok, byte = build_tokenizer("byte_chat"), ByteTokenizer()
    text = "héllo wörld ✓ 数据\n\tdef f(x): return x ** 2  # <s"
    assert tok.encode(text) == byte.encode(text) and tok.decode(tok.encode(text)) == text
    assert tok.encode("a<|im_end|>") == [97, 260]  # special tokens spelled out in text are the tokens
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258, 261)
    tok.hf.save_pretrained(tmp_path)  # an ordinary tokenizer folder, read back by AutoTokenizer
    again = build_tokenizer(str(tmp_path))
    assert again.hf.chat_template == BYTE_CHAT_TEMPLATE
    assert [ids.tolist() for ids, _ in render(again, CHATS)] == [ids.tolist() for ids, _ in render(tok, CHATS)]


@pytest.mark.parametrize("train_on", ["assistant", "last", "all"])
def test_masks_are_transformers_and_the_text_each_turn_writes(train_on):
    """Both paths (the template's {% generation %} spans, and rendering each prefix of the same
    template without them) give transformers' tokens, and targets that decode to exactly what
    the assistant wrote; with spans, the mask is return_assistant_tokens_mask itself."""
    tagged, plain = tokenizer(), tokenizer(PLAIN)
    for chat, writes, (ids, flags), (ids2, flags2) in zip(CHATS, WRITES, render(tagged, CHATS, train_on),
                                                          render(plain, CHATS, train_on)):
        hf = tagged.hf.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids.tolist() == ids2.tolist() == hf["input_ids"]
        assert flags.tolist() == flags2.tolist()
        if train_on == "all":
            assert flags.all()
            continue
        if train_on == "assistant":
            assert flags.tolist() == hf["assistant_masks"]
        assert tagged.decode(ids[flags].tolist()) == expected(writes, train_on)


def test_labels_are_the_next_token_where_it_is_a_target(tmp_path):
    """Through the loader (a .jsonl file, the tokenizer saved as a folder): every chat is packed
    whole into one sample, each position's label is the chat's next token or IGNORE_INDEX, the
    labels kept decode to what the assistants wrote, and each chat's positions start at 0."""
    rows = tmp_path / "chats.jsonl"
    rows.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    tokenizer().hf.save_pretrained(tmp_path / "tok")
    cfg = Data(path=str(rows), tokenizer=str(tmp_path / "tok"), format="chat", document_mask=True, shuffle=False,
               holdout_fraction=0.0)
    tok = build_tokenizer(cfg.tokenizer)
    loader = build_dataloader(cfg, tok, seq_len=512, global_batch_size=1, local_batch_size=1, dp_rank=0, dp_degree=1)
    assert loader.dataset.num_samples == 1 and loader.dataset.truncated == loader.dataset.dropped == 0
    batch = {k: v[0] for k, v in next(iter(loader)).items()}
    ids, labels, docs, positions = batch["input_ids"], batch["labels"], batch["document_ids"], batch["positions"]
    assert tok.decode(labels[labels != IGNORE_INDEX].tolist()) == "".join(expected(w, "assistant") for w in WRITES)
    for doc, (chat_ids, flags) in enumerate(render(tok, CHATS)):
        at = (docs == doc).nonzero().flatten()
        assert positions[at].tolist() == list(range(len(chat_ids) - 1))
        assert ids[at].tolist() == chat_ids[:-1].tolist()
        want = [int(t) if f else IGNORE_INDEX for t, f in zip(chat_ids[1:], flags[1:])]
        assert labels[at].tolist() == want
    pad = docs == len(CHATS)  # the rest: padding, a document of its own, never a target
    assert (ids[pad] == tok.pad_id).all() and (labels[pad] == IGNORE_INDEX).all() and pad.sum() > 0


def test_every_source_kind_gives_the_same_chats(tmp_path):
    """.jsonl, .parquet (messages as a list of structs, absent keys read back as None) and a
    datasets save_to_disk folder."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": c} for c in CHATS]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    datasets.disable_progress_bars()
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    tok, want = tokenizer(), [(ids.tolist(), flags.tolist()) for ids, flags in render(tokenizer(), CHATS)]
    for kind in ("c.jsonl", "c.parquet", "ds"):
        got = read_chats(str(tmp_path / kind), "messages", "train", tok, "byte_chat", "assistant")
        assert [(ids.tolist(), flags.tolist()) for ids, flags in got] == want, kind


def test_a_template_that_rewrites_earlier_turns_is_refused():
    """Rendered up to its own turn, an earlier answer shows its reasoning; with later turns after
    it, the template drops it: no prefix rendering can mask that chat, so it is refused (with
    train_on last, the last turn is rendered as it is trained)."""
    rewrites = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if loop.last and m.reasoning %}"
                "<think>{{ m.reasoning }}</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    chat = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "reasoning": "one and one", "content": "2"},
            {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "reasoning": "two and two", "content": "4"}]
    with pytest.raises(ConfigError, match=r"^data.path: row 1: the chat template renders message 2 \(assistant\) "
                                          r"differently once later messages follow \(it rewrites earlier turns\)"):
        render(tokenizer(rewrites), [chat])
    ((ids, flags),) = render(tokenizer(rewrites), [chat], "last")
    assert tokenizer().decode(ids[flags].tolist()) == "<think>two and two</think>4" + END
    with pytest.raises(ConfigError, match="the chat opens with an assistant turn"):
        render(tokenizer(PLAIN), [chat[1:2]])


BAD_ROWS = {
    "no messages": (None, "no 'messages', not a list of messages; set data.messages_field"),
    "text for messages": ("hello", "'messages' is a str, not a list of messages"),
    "no message": ([], "'messages' is an empty list"),
    "unknown role": ([{"role": "narrator", "content": "x"}], "message 1 has role 'narrator'; each message needs a "
                                                             "role among system, user, assistant, tool"),
    "not a message": (["hi"], "message 1 has a str, not a message"),
    "empty assistant turn": ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}],
                             "message 2 is an empty assistant turn"),
    "nothing to train on": ([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
                            "no token to train on with data.train_on = assistant"),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_bad_rows_are_refused_in_one_line(case):
    row, match = BAD_ROWS[case]
    with pytest.raises(ConfigError) as err:
        render(tokenizer(), [CHATS[0], row])
    assert str(err.value).startswith("data.path: row 2: ") and match in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_a_tokenizer_without_a_chat_template_is_refused():
    for tok in (tokenizer(None), ByteTokenizer()):
        with pytest.raises(ConfigError, match=r"^data.tokenizer 'byte_chat' has no chat template"):
            render(tok, CHATS)


def best_fit_decreasing(lengths: list[int], room: int) -> list[int]:
    """The room each bin has left, by the textbook's quadratic loop (which of several bins with the
    same room takes an item changes no later choice)."""
    left: list[int] = []
    for n in sorted(lengths, reverse=True):
        fits = [b for b in range(len(left)) if left[b] >= n]
        if fits:
            left[min(fits, key=lambda b: left[b])] -= n
        else:
            left.append(room - n)
    return sorted(left)


def test_best_fit_decreasing_packing():
    assert pack([5, 3, 4, 2, 6], 8) == [[3, 4], [0, 1], [2]]
    for seed in range(3):
        lengths = np.random.default_rng(seed).integers(1, 65, 500).tolist()
        bins = pack(lengths, 64)
        assert sorted(i for b in bins for i in b) == list(range(500))
        assert sorted(64 - sum(lengths[i] for i in b) for b in bins) == best_fit_decreasing(lengths, 64)


def test_overlong_chats_are_truncated_or_dropped_and_counted():
    ids = np.arange(10, dtype=np.uint32)
    early, late = np.zeros(10, dtype=bool), np.zeros(10, dtype=bool)
    early[3:5], late[8:] = True, True
    chats = ((ids, early), (ids, late), (ids[:4], early[:4]))  # 10 tokens take 9 positions; seq_len 6
    cut = ChatSamples(chats, 6, "truncate", 0, shuffle=False, seed=0)
    assert (cut.truncated, cut.dropped, len(cut.chats)) == (1, 1, 2)  # the late targets do not survive the cut
    assert cut[0]["labels"].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 3, 4, IGNORE_INDEX, IGNORE_INDEX]
    drop = ChatSamples(chats, 6, "drop", 0, shuffle=False, seed=0)
    assert (drop.truncated, drop.dropped, len(drop.chats)) == (0, 2, 1)


def test_packed_loss_is_the_mean_over_targets_of_each_chat_alone():
    """fp32: the loss of packed samples (sum over targets / their count, as the step computes it)
    equals the mean over the same chats' targets run one at a time, to 1e-5. The mean of each
    sample's own mean (the wrong normaliser) is measurably off."""
    tok = tokenizer()
    chats = tuple(render(tok, [c for _, c in stdlib_chats()[:24]]))
    data = ChatSamples(chats, 256, "truncate", tok.pad_id, shuffle=False, seed=0)
    assert data.truncated and data.num_samples < len(data.chats) - data.dropped  # chats share samples
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(flavors["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                            max_seq_len=256, vocab_size=tok.vocab_size))
    model.init_weights(0)
    rows = [data[g] for g in range(data.num_samples)]
    with torch.no_grad():
        sums, counts = [], []
        for r in rows:
            logits = model(r["input_ids"][None], AttnContext(r["positions"][None], r["document_ids"][None]))
            sums.append(cross_entropy_sum(logits, r["labels"][None]))
            counts.append((r["labels"] != IGNORE_INDEX).sum())
        packed = sum(sums) / sum(counts)
        alone_sum, alone_count = 0.0, 0
        for ids, flags in data.chats:
            ids = torch.from_numpy(ids.astype(np.int64))
            labels = torch.where(torch.from_numpy(flags[1:]), ids[1:], IGNORE_INDEX)
            alone_sum += cross_entropy_sum(model(ids[None, :-1]), labels[None])
            alone_count += int((labels != IGNORE_INDEX).sum())
    alone = alone_sum / alone_count
    assert abs(packed - alone) / alone < 1e-5, (packed, alone)
    per_sample = sum(s / c for s, c in zip(sums, counts)) / len(rows)
    assert abs(per_sample - alone) / alone > 1e-4


def test_chat_order_is_layout_independent_and_resumes(tmp_path):
    """The packed samples a global batch holds are the same for dp 1 and dp 2 (each rank building
    its own data set), and a loader restored from a cursor goes on with the same batches."""
    rows = tmp_path / "chats.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}" * (i % 5 + 1)},
                                                     {"role": "assistant", "content": f"a{i}" * (i % 7 + 1)}]}) + "\n"
                            for i in range(300)))
    cfg = Data(path=str(rows), tokenizer="byte_chat", format="chat", document_mask=True, holdout_fraction=0.0)
    tok = build_tokenizer("byte_chat")

    def loader(rank: int, dp: int):
        read_chats.cache_clear()  # as a rank of its own would: rendered and packed again
        return build_dataloader(cfg, tok, seq_len=64, global_batch_size=8, local_batch_size=8 // dp // 2,
                                dp_rank=rank, dp_degree=dp)

    one, two = iter(loader(0, 1)), [iter(loader(r, 2)) for r in range(2)]
    for _ in range(3):  # each step's global batch: 2 micro-batches on one rank, 2 on each of two
        whole = torch.cat([next(one)["input_ids"] for _ in range(2)])
        assert torch.equal(whole, torch.cat([next(r)["input_ids"] for r in two for _ in range(2)]))
    first = loader(0, 1)
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()
    ahead = [next(it)["labels"] for _ in range(4)]
    resumed = loader(0, 1)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b["labels"]) for a, b in zip(ahead, iter(resumed)))
