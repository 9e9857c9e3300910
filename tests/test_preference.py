"""Preference optimization (data.format preference, [preference]): the pair data, the losses against
TRL 1.16's own code on the same transformers model and batch, and the ln 2 of a policy equal to its
reference. The layouts launch is in tests/test_preference_layouts.py."""

from __future__ import annotations

import json
import math
import re
import types
from collections import defaultdict

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from trl import DPOTrainer
from trl.experimental.cpo import CPOTrainer
from trl.trainer.utils import add_fused_lm_head

from titanlite.config.data import Data, Preference, Validation, check_data, check_preference
from titanlite.data.pairs import PAIR, REFERENCE, RESPONSE, TOKEN, PairSamples, pair_samples, target_count
from titanlite.data.tokenizer import build_tokenizer
from titanlite.errors import ConfigError
from titanlite.layers.attention import AttnSetup
from titanlite.loss import IGNORE_INDEX, token_logprobs
from titanlite.models.llama3 import SPEC
from titanlite.models.llama3.model import Transformer
from titanlite.preference import PreferenceLoss, fill_sft, pair_logps, pair_losses

VOCAB = 96
CONFIG = dict(hidden_size=48, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=128,
              rms_norm_eps=1e-5, attn_implementation="eager")


def _pairs(n: int, seed: int = 0) -> tuple:
    """n pairs of token ids: a shared prompt, then each response; flags mark the responses' tokens."""
    g = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = g.integers(0, VOCAB, g.integers(3, 9))
        pair = []
        for _ in range(2):
            response = g.integers(0, VOCAB, g.integers(2, 8))
            ids = np.concatenate([prompt, response]).astype(np.uint32)
            pair.append((ids, np.arange(len(ids)) >= len(prompt)))
        out.append(tuple(pair))
    return tuple(out)


def _hf(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _ours(hf: LlamaForCausalLM) -> Transformer:
    args = SPEC.hf.args_from_hf(hf.config.to_dict())
    model = Transformer(args)
    model.load_state_dict(SPEC.hf.from_hf(hf.state_dict(), args), strict=True)
    return model.eval(), args


def _trl_inputs(pairs: tuple) -> dict[str, torch.Tensor]:
    """TRL's collated batch: the chosen rows, then the rejected, right-padded (pad 0, mask 0)."""
    rows = [pair[0] for pair in pairs] + [pair[1] for pair in pairs]
    width = max(len(ids) for ids, _ in rows)
    ids, attention, completion = (torch.zeros(len(rows), width, dtype=torch.long) for _ in range(3))
    for i, (x, flags) in enumerate(rows):
        ids[i, :len(x)] = torch.from_numpy(x.astype(np.int64))
        attention[i, :len(x)] = 1
        completion[i, :len(x)] = torch.from_numpy(flags.astype(np.int64))
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def _trl_dpo(kind: str, beta: float, policy, ref, inputs, sft: float = 0.0) -> torch.Tensor:
    """DPOTrainer._compute_loss itself on `policy` and `ref` (fused heads added as the trainer does)."""
    identity = types.SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x,
                                     unwrap_model=lambda m: m)
    trainer = types.SimpleNamespace(
        model=policy, ref_model=ref, accelerator=identity, aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=False, f_divergence_type="reverse_kl", loss_types=[kind, "sft"] if sft else [kind],
        loss_weights=[1.0, sft] if sft else [1.0], beta=beta,
        use_weighting=False, label_smoothing=0.0, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1, args=types.SimpleNamespace(gradient_checkpointing_kwargs=None))
    return DPOTrainer._compute_loss(trainer, policy, inputs, False)


def _trl_simpo(beta: float, gamma: float, policy, inputs) -> torch.Tensor:
    """CPOTrainer's simpo: its get_batch_logps (length-averaged) and cpo_loss."""
    labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    logits = policy(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    logps = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    chosen, rejected = logps.chunk(2)
    trainer = types.SimpleNamespace(loss_type="simpo", beta=beta, simpo_gamma=gamma, label_smoothing=0.0, alpha=0.0,
                                    accelerator=types.SimpleNamespace(device=torch.device("cpu")))
    return CPOTrainer.cpo_loss(trainer, chosen, rejected)[0].mean()


@pytest.mark.parametrize("kind,sft", [("dpo", 0.0), ("ipo", 0.0), ("simpo", 0.0), ("dpo_norm", 0.0), ("dpo", 0.7)])
def test_loss_and_every_gradient_equal_trl_on_the_same_model_and_batch(kind, sft):
    """Pairs packed several per sample (document masks) through titanlite's model give TRL 1.16's loss
    (its own DPOTrainer / CPOTrainer code over a padded [chosen; rejected] batch of the same
    transformers model) and the same gradient on every weight, within 1e-5; with sft_weight, TRL's
    loss_type [sigmoid, sft] and loss_weights [1, sft_weight] (its mean over the batch's chosen tokens)."""
    pairs = _pairs(7)
    policy, ref = _hf(0), _hf(1)  # a reference unlike the policy: the log-ratios are not 0
    ours, args = _ours(policy)
    ours_ref, _ = _ours(ref)
    samples = PairSamples(pairs, 48, 0, shuffle=False, seed=0)
    assert samples.num_samples < len(pairs)  # several pairs per sample
    batch = {k: torch.stack([samples[g][k] for g in range(samples.num_samples)])
             for k in ("input_ids", "labels", "document_ids", "positions")}
    ctx = AttnSetup().context(batch["positions"], batch["document_ids"], seq_len=48)
    labels = batch["labels"]
    with torch.no_grad():
        ref_lp = token_logprobs(ours_ref(batch["input_ids"], ctx), labels[..., TOKEN])
    labels[..., REFERENCE] = ref_lp.view(torch.int32).to(torch.int64)
    p = Preference(loss=kind, beta=0.5, gamma=0.3, sft_weight=sft)
    fill_sft([labels], None)
    loss = PreferenceLoss(p)(ours(batch["input_ids"], ctx), labels) / target_count(labels)
    loss.backward()
    trl_kind = {"dpo": "sigmoid", "dpo_norm": "sigmoid_norm"}.get(kind, kind)
    inputs = _trl_inputs(pairs)
    if kind == "simpo":
        theirs = _trl_simpo(p.beta, p.gamma, policy, inputs)
    else:
        add_fused_lm_head(policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
        add_fused_lm_head(ref)
        theirs = _trl_dpo(trl_kind, p.beta, policy, ref, inputs, sft)
    theirs.backward()
    assert abs(loss.item() - theirs.item()) <= 1e-5, (loss.item(), theirs.item())
    grads = SPEC.hf.to_hf({n: q.grad for n, q in ours.named_parameters()}, args)
    worst = max((grads[n] - q.grad).abs().max().item() for n, q in policy.named_parameters())
    assert max(q.grad.abs().max().item() for q in policy.parameters()) > 1e-3  # gradients that can differ
    print(f"{kind} sft {sft}: loss {loss.item():.7f} vs TRL {theirs.item():.7f}, worst gradient difference {worst:.1e}")
    assert worst <= 1e-5


def test_a_policy_equal_to_its_reference_gives_ln2_for_every_pair():
    """Every pair's DPO loss is ln 2 and every reward 0 when policy and reference are one model: the
    reference channel of the labels holds exactly the policy's summed terms."""
    pairs = _pairs(9, seed=3)
    model, _ = _ours(_hf(0))
    samples = PairSamples(pairs, 40, 0, shuffle=False, seed=0)
    batch = {k: torch.stack([samples[g][k] for g in range(samples.num_samples)])
             for k in ("input_ids", "labels", "document_ids", "positions")}
    ctx = AttnSetup().context(batch["positions"], batch["document_ids"], seq_len=40)
    logits = model(batch["input_ids"], ctx)
    labels = batch["labels"]
    labels[..., REFERENCE] = token_logprobs(logits, labels[..., TOKEN]).detach().view(torch.int32).to(torch.int64)
    losses, metrics = pair_losses(Preference(), *pair_logps(logits, labels, 1, None))
    losses = losses[metrics["pairs"] > 0]
    assert len(losses) == len(pairs) == target_count(labels)
    assert torch.equal(losses, torch.full_like(losses, math.log(2)))
    assert not metrics["rewards/chosen"].any() and not metrics["rewards/accuracies"].any()


def test_pairs_are_packed_whole_with_response_only_targets():
    """Each pair's two responses are documents of one sample; only the response tokens are targets,
    each labelled with its response's segment; one PAIR mark per pair."""
    pairs = _pairs(12, seed=5)
    samples = PairSamples(pairs, 40, 0, shuffle=True, seed=1)
    seen = 0
    for g in range(samples.num_samples):
        x = samples[g]
        labels, docs = x["labels"], x["document_ids"]
        on = labels[:, TOKEN] != IGNORE_INDEX
        assert torch.equal(on, labels[:, RESPONSE] >= 0)
        n = int(labels[:, PAIR].sum())
        assert set(labels[on, RESPONSE].tolist()) == set(range(2 * n))  # both responses of each pair here
        for r in range(2 * n):  # a response's targets lie in one document, its tokens the pair's flags
            assert len(set(docs[labels[:, RESPONSE] == r].tolist())) == 1
        seen += n
    assert seen == len(pairs)
    targets = sum(int(f[1:].sum()) for pair in pairs for _, f in pair)
    assert targets == sum(int((samples[g]["labels"][:, TOKEN] != IGNORE_INDEX).sum())
                          for g in range(samples.num_samples))


def test_the_builtin_set_is_paired_within_each_split():
    """The built-in set's held-out pairs share no response with its training pairs: paired across
    the split, every held-out chosen answer was a training rejected one and every held-out rejected
    a training chosen one; split by function name, a docstring two functions share fell on both
    sides. The held-out pairs are a sample of the modules (not the last ones, unlike any trained on).
    Each chosen answer repeats a word of its question's function name and no rejected one does; a
    rejected answer is a GUI module's docstring, a chosen one never is. The rejected answer is
    within 10% of the chosen one's length."""
    from titanlite.data.chat_set import stdlib_chats
    from titanlite.data.pairs import GUI_MODULES, builtin_pairs, name_words
    train, val = builtin_pairs(0.05, "train"), builtin_pairs(0.05, "val")
    texts = [{row[f][0]["content"] for _, row in pairs for f in ("chosen", "rejected")} for pairs in (train, val)]
    assert len(val) > 80 and not texts[0] & texts[1], texts[0] & texts[1]
    assert (len(train), len(val)) == (2040, 94)  # of 3,811 and 201 chats
    modules = [{where.rsplit(", ", 1)[1].split(".")[0] for where, _ in pairs} for pairs in (train, val)]
    assert len(modules[1]) > 40 and len(modules[1] - modules[0]) < 0.1 * len(modules[1]), modules[1] - modules[0]
    gui = {m["content"] for where, chat in stdlib_chats() if where.rsplit(", ", 1)[1].split(".")[0] in GUI_MODULES
           for m in chat if m["role"] == "assistant"}
    for where, row in train + val:
        name = name_words(where.rsplit(", ", 1)[1])
        chosen, rejected = row["chosen"][0]["content"], row["rejected"][0]["content"]
        assert name & name_words(chosen) and not name & name_words(rejected)
        assert abs(len(chosen) - len(rejected)) <= len(chosen) // 10
        assert rejected in gui and where.rsplit(", ", 1)[1].split(".")[0] not in GUI_MODULES
    assert name_words("Return the ZipFile's bytes, is_zipfile") == {"return", "the", "zip", "file", "bytes", "zipfile"}


def test_preference_rows_and_their_bad_input(tmp_path):
    """TRL's conversational rows render with the chat template, the prompt never a target; each bad
    row or setting is one line naming it."""
    tok = build_tokenizer("byte_chat")
    good = {"prompt": [{"role": "user", "content": "Hi?"}], "chosen": [{"role": "assistant", "content": "Hello."}],
            "rejected": {"role": "assistant", "content": "Go away."}}
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(good) for _ in range(4)) + "\n")
    cfg = Data(path=str(path), format="preference", tokenizer="byte_chat", document_mask=True, holdout_fraction=0.0)
    x = pair_samples(cfg, tok, 128, "train")[0]
    text = bytes(int(t) for t in x["labels"][:, TOKEN] if 0 <= t < 256)  # the special tokens left out
    assert text.count(b"Hello.") == text.count(b"Go away.") >= 1 and b"Hi?" not in text
    cases = {"no 'rejected'": {**good, "rejected": None}, "chosen equals rejected": {**good, "rejected": good["chosen"]}}
    for i, (line, row) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}.jsonl"
        bad.write_text(json.dumps(row) + "\n")
        with pytest.raises(ConfigError, match=line):
            pair_samples(Data(path=str(bad), format="preference", tokenizer="byte_chat", document_mask=True,
                              holdout_fraction=0.0), tok, 128, "train")
    with pytest.raises(ConfigError, match="prompt alone is"):
        pair_samples(cfg, tok, 8, "train")
    data = Data(format="preference", tokenizer="byte_chat", document_mask=True)
    for p, lora, line in [(Preference(reference="model"), True, "copy the model needlessly"),
                          (Preference(beta=0.0), True, "beta must be > 0"),
                          (Preference(), False, "needs LoRA")]:
        with pytest.raises(ConfigError, match=line):
            check_preference(p, data, lora)
    for lora in (True, False):  # precomputed sums serve either
        check_preference(Preference(reference="precomputed"), data, lora)
    with pytest.raises(ConfigError, match="schedule ZBVZeroBubble cannot run the reference pass"):
        check_preference(Preference(), data, True, pp_schedule="ZBVZeroBubble")
    with pytest.raises(ConfigError, match="set training.z_loss = 0"):
        check_preference(Preference(), data, True, z_loss=1e-4)
    with pytest.raises(ConfigError, match="would split preference pairs"):
        check_preference(Preference(), data, True, seq_warmup=True)
    with pytest.raises(ConfigError, match="data.format preference reads its rows whole"):
        check_data(Data(path=str(path), format="preference", tokenizer="byte_chat", streaming=True), Validation())


def test_the_dry_run_traces_the_reference_forward(capsys):
    """A preference job's dry run traces the reference's forward beside the policy's forward and
    backward: more FLOPs than the reference-free simpo on the same job; a precomputed reference
    (computed once before the first step) adds none to a step."""
    from titanlite.dryrun.run import main
    flops = {}
    for name, args in {"dpo": [], "simpo": ["--preference.loss", "simpo"],
                       "precomputed": ["--preference.reference", "precomputed"]}.items():
        main(["--config", "dpo_debug.toml", *args])
        flops[name] = float(re.search(r"FLOPs per step ([0-9.e+]+)", capsys.readouterr().out).group(1))
    assert flops["dpo"] > 1.2 * flops["simpo"], flops
    assert flops["precomputed"] == flops["simpo"], flops


def test_adapters_off_is_the_base_model_bit_for_bit_and_log_probs_sum_by_segment():
    """The reference of a LoRA run (preference, RL) is the model with its adapters off: bitwise
    the model before LoRA, even with dropout set and the model in train mode. token_logprobs
    and segment_sums are what those losses sum: log_softmax gathered at the labels, by segment."""
    from titanlite.checkpoint.lora import setup_lora
    from titanlite.config.job import LoRA
    from titanlite.layers.lora import adapters_off, apply_lora
    from titanlite.loss import segment_sums
    from titanlite.model_spec import get_model_spec, model_args
    spec = get_model_spec("llama3")
    args = model_args(spec, "debugmodel", 0, 32)
    model = spec.build(args)
    model.init_weights(3)
    ids = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    ctx = AttnSetup().context(None, None, seq_len=12, device=ids.device)
    base = model(ids, ctx)
    setup = setup_lora(LoRA(rank=4, alpha=8, dropout=0.5, target_modules=["wq", "w2"]), spec, args)
    apply_lora(model, setup)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(generator=torch.Generator().manual_seed(1))
    model.train()
    assert (model(ids, ctx) - base).abs().max() > 1e-3  # the adapters (and dropout) move the logits
    with adapters_off(model):
        assert torch.equal(model(ids, ctx), base)
    labels = ids.roll(-1, 1)
    labels[0, :3] = IGNORE_INDEX
    lp = token_logprobs(base, labels)
    want = base.float().log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    torch.testing.assert_close(lp, torch.where(labels == IGNORE_INDEX, 0.0, want), rtol=0, atol=1e-6)
    segments = torch.full_like(labels, -1)
    segments[0, 3:7], segments[0, 7:], segments[1, 2:] = 0, 1, 2
    sums = segment_sums(lp, segments, 3)
    torch.testing.assert_close(sums, torch.stack([want[0, 3:7].sum(), want[0, 7:].sum(), want[1, 2:].sum()]))


def test_a_frozen_reference_resumes_only_from_a_checkpoint_that_holds_it(tmp_path):
    """A full fine-tune's reference (preference.reference = model, or its precomputed sums) is its
    starting weights': resumed from a checkpoint without one (here a reference-free simpo run's), it
    would be taken from the resumed weights, another model, silently. Refused in one line naming
    the route."""
    from harness import TINY, launch, train
    from test_preference_layouts import write_pairs

    base = [*TINY, "--training.seq_len", "128", "--training.global_batch_size", "4", "--training.local_batch_size",
            "4", "--data.path", str(write_pairs(tmp_path / "pairs.jsonl", 40)), "--data.format", "preference",
            "--data.tokenizer", "byte_chat", "--data.document_mask", "true", "--checkpoint.enable", "true",
            "--checkpoint.interval", "2", "--training.steps", "2"]
    train(1, [*base, "--preference.loss", "simpo", "--preference.reference", "model"], dump=tmp_path / "run")
    for kind in ("model", "precomputed"):  # precomputed: the sums would be the resumed weights' too
        run = launch(1, [*base, "--preference.reference", kind, "--training.steps", "4"], dump=tmp_path / "run")
        assert run.returncode != 0
        line = next(x for x in run.output.splitlines() if "holds no reference state" in x)
        assert "checkpoint.initial_load_path" in line, line
    # the precomputed sums resumed over the same number of other pairs (the file's rows reversed)
    train(1, [*base, "--preference.reference", "precomputed"], dump=tmp_path / "pre")
    rows = (tmp_path / "pairs.jsonl").read_text().splitlines()
    (tmp_path / "pairs.jsonl").write_text("".join(r + "\n" for r in reversed(rows)))
    run = launch(1, [*base, "--preference.reference", "precomputed", "--training.steps", "4"], dump=tmp_path / "pre")
    assert run.returncode != 0
    line = next(x for x in run.output.splitlines() if "reference sums are of other pairs" in x)
    assert line.startswith("titanlite: error:") and "checkpoint.initial_load_path" in line, line
