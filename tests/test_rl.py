"""GRPO (titanlite.rl): the loss against TRL's, advantages, the KL at the start; the dry run's GRPO step time."""

from __future__ import annotations

import contextlib
import json
import re
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from titanlite.loss import IGNORE_INDEX
from titanlite.rl.loss import PolicyLoss, group_advantages, token_scale

LOSS_TYPES = {"token": "dapo", "sequence": "grpo", "group": "dr_grpo"}


def _trl_loss(model, inputs: dict, loss_type: str, beta: float, eps: tuple[float, float], temperature: float,
              max_new: int) -> torch.Tensor:
    """TRL 1.16's GRPOTrainer._compute_loss, called on a stand-in for the trainer holding what it reads."""
    trl = pytest.importorskip("trl.trainer.grpo_trainer")
    trainer_cls = trl.GRPOTrainer
    acc = SimpleNamespace(num_processes=1, is_main_process=True, autocast=contextlib.nullcontext, gather=lambda x: x,
                          gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x, sync_gradients=True)
    me = SimpleNamespace(model=model, accelerator=acc, temperature=temperature, top_entropy_quantile=1.0,
                         off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
                         loss_type=loss_type, epsilon_low=eps[0], epsilon_high=eps[1], use_vllm=False,
                         current_gradient_accumulation_steps=1, max_completion_length=max_new,
                         _entropy_bonus_enabled=False, aux_loss_enabled=False,
                         _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                         args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1))
    me._get_per_token_logps_and_entropies = trainer_cls._get_per_token_logps_and_entropies.__get__(me)
    return trainer_cls._compute_loss(me, model, inputs)


def _tiny_hf():
    transformers = pytest.importorskip("transformers")
    from trl.trainer.utils import add_fused_lm_head
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    return model


def test_loss_equals_trl_for_each_norm():
    """On a fixed batch of completions (ragged prompts and completions, two groups, one of equal
    rewards), titanlite's loss and its gradients equal TRL 1.16's GRPO loss for each loss_norm, with
    clipping (old log-probs given), DAPO's clip_eps_high and the k3 KL to a reference."""
    model = _tiny_hf()
    g = torch.Generator().manual_seed(1)
    batch, prompt_len, max_new, temp, eps = 6, 5, 7, 0.7, (0.2, 0.28)
    prompt_ids = torch.randint(1, 64, (batch, prompt_len), generator=g)
    prompt_mask = torch.ones(batch, prompt_len, dtype=torch.long)
    prompt_mask[1, :2] = 0  # left padding
    lengths = torch.tensor([7, 3, 5, 1, 6, 7])
    completion_ids = torch.randint(1, 64, (batch, max_new), generator=g)
    completion_mask = (torch.arange(max_new) < lengths[:, None]).long()
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # the second group's rewards are all equal
    adv = group_advantages(rewards, 3)
    assert (adv[3:] == 0).all() and adv[:3].abs().min() > 0.5
    old = -torch.rand(batch, max_new, generator=g) * 4  # far from the policy's: many ratios clipped
    ref = -torch.rand(batch, max_new, generator=g) * 4
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    labels = torch.full((batch, ids.shape[1] - 1), IGNORE_INDEX)
    window = slice(prompt_len - 1, prompt_len - 1 + max_new)
    labels[:, window] = completion_ids.masked_fill(completion_mask == 0, IGNORE_INDEX)

    def spread(x: torch.Tensor) -> torch.Tensor:  # per completion token -> aligned with labels
        out = torch.zeros(labels.shape)
        out[:, window] = x
        return out

    n_tokens = int(lengths.sum())
    for norm, loss_type in LOSS_TYPES.items():
        for beta in (0.0, 0.05):
            model.zero_grad()
            inputs = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                          completion_mask=completion_mask, advantages=adv, old_per_token_logps=old,
                          ref_per_token_logps=ref, num_items_in_batch=torch.tensor(float(n_tokens)))
            theirs = _trl_loss(model, inputs, loss_type, beta, eps, temp, max_new)
            theirs.backward()
            want = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            scale = token_scale(lengths, n_tokens, batch, norm, max_new).float()
            loss, stats = PolicyLoss(eps[0], eps[1], beta, temp)(
                logits, labels, spread(adv[:, None].expand(-1, max_new)), spread(scale[:, None].expand(-1, max_new)),
                spread(old), spread(ref))
            (loss / n_tokens).backward()
            assert abs(loss.item() / n_tokens - theirs.item()) <= 1e-5, (norm, beta, loss.item() / n_tokens, theirs)
            worst = max((p.grad - w).abs().max().item() for p, w in zip(model.parameters(), want))
            assert worst <= 1e-5, (norm, beta, worst)
            assert stats[1] > 0 and stats[3] == n_tokens  # clipping happened; every completion token counted


def test_kl_zero_when_policy_is_reference():
    """At step 1 the policy is its reference: the k3 KL is exactly 0 and so is its gradient."""
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 16, requires_grad=True)
    labels = torch.tensor([[3, 4, IGNORE_INDEX, IGNORE_INDEX], [IGNORE_INDEX, 1, 2, 3]])
    from titanlite.loss import token_logprobs
    ref = token_logprobs(logits.detach(), labels)
    zeros = torch.zeros(labels.shape)
    loss, stats = PolicyLoss(0.2, 0.2, 0.1, 1.0)(logits, labels, zeros, torch.ones(labels.shape), None, ref)
    loss.backward()
    assert stats[0] == 0 and loss == 0 and (logits.grad == 0).all()


RL = ["--model.flavor", "debugmodel", "--training.seq_len", "64", "--training.steps", "6", "--metrics.log_freq", "1",
      "--lr_scheduler.warmup_steps", "2", "--metrics.enable_tensorboard", "false", "--data.holdout_fraction", "0.0",
      "--rl.enable", "true", "--rl.group_size", "4", "--rl.max_new_tokens", "8", "--rl.reward", "__main__:varied",
      "--training.global_batch_size", "8", "--lora.rank", "4", "--lora.target_modules", "wq,wv,w2",
      "--rl.kl_coef", "0.05", "--rl.updates_per_batch", "2", "--rl.clip_eps_high", "0.28",
      "--rl.loss_norm", "sequence", "--optimizer.lr", "3e-2"]
FULL = [*RL[:RL.index("--lora.rank")], *RL[RL.index("--rl.kl_coef"):-1], "3e-3"]
"""The same run, every weight trained: the KL's reference is a frozen copy of the start."""


def _close(a: float, b: float, rtol: float, atol: float = 1e-7) -> bool:
    return abs(a - b) <= rtol * abs(a) + atol


def test_grpo_layouts_equal_one_process_and_resume_regenerates(tmp_path):
    """One gloo launch of tests/rl_layouts.py: GRPO (KL 0.05 to a reference, 2 updates per batch of
    rollouts, DAPO's clip-higher) with LoRA (the reference: adapters off; the prompts: a chat
    source's rows, data.format = "chat", no training data read) on TP 2, and fully
    fine-tuned (the reference: a frozen copy of the start, FSDP-sharded and checkpointed) on FSDP 2
    (saving every 2 steps) and FSDP 2 resumed from step 4, each against one process: the rewards
    exactly, the losses, KL and gradient norms within 1e-4 (1e-6 at step 1, where the KL is 0:
    policy = reference); the resumed run regenerates the straight run's completions, and its
    frozen reference is the straight run's, not the weights it resumes: its losses are bitwise."""
    from harness import REPO, spawn_ranks
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    chats = tmp_path / "chats.jsonl"  # the LoRA runs' prompts: a chat source's rows ending in a user turn
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{a} + {b} ="}], "answer": a + b})
                             + "\n" for a in range(3) for b in range(3)))
    chat = ["--data.format", "chat", "--data.path", str(chats), "--data.document_mask", "true", "--data.tokenizer",
            "byte_chat"]
    runs = {"fsdp2": [*FULL, "--training.local_batch_size", "4", *ckpt, "--job.run_name", "straight"],
            "resumed": [*FULL, "--training.local_batch_size", "4", *ckpt, "--job.run_name", "resumed",
                        "--checkpoint.load_step", "4"],
            "tp2": [*RL, *chat, "--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2",
                    "--parallelism.sequence_parallel", "false"]}
    dumps = {name: tmp_path / ("fsdp2" if name == "resumed" else name) for name in runs}
    script = str(REPO / "tests" / "rl_layouts.py")

    def launch(nproc: int, named: dict[str, list[str]]) -> str:
        argv = " + ".join(" ".join([*a, "--job.dump_folder", str(dumps[n])]) for n, a in named.items())
        codes, out = spawn_ranks(nproc, [script, *argv.split()], timeout=900)
        assert all(c in (0, -6) for c in codes) and out.count("run ") >= nproc * len(named), (codes, out[-4000:])
        return out

    for name in ("one", "one_full", "bad"):
        dumps[name] = tmp_path / name
    out = launch(1, {"one": [*RL, *chat, "--training.local_batch_size", "8"],
                     "one_full": [*FULL, "--training.local_batch_size", "8"],
                     "bad": [*RL, "--training.local_batch_size", "8", "--rl.reward", "__main__:not_a_number"]})
    assert re.findall(r"titanlite: error: .*", out) == [
        "titanlite: error: rl.reward __main__:not_a_number returned a non-number (or not finite) for prompt 2732 "
        "(sample 0) of step 1; it must return an int or float"], out[-3000:]
    launch(2, runs)

    def rows(name: str, run: str | None = None) -> list[dict]:
        got = [json.loads(x) for x in (dumps[name] / "metrics.jsonl").read_text().splitlines()]
        return [r for r in got if "loss" in r and (run is None or r["run"] == run)]

    for one in ("one", "one_full"):
        ref = rows(one)
        assert len(ref) == 6 and ref[0]["rl/kl"] == 0 and ref[-1]["rl/kl"] > 0 and ref[-1]["rl/clip_fraction"] > 0
        assert len({r["rl/reward_mean"] for r in ref}) > 1 and all(r["rl/reward_std"] > 0 for r in ref)
    for one, name, run in (("one_full", "fsdp2", "straight"), ("one", "tp2", None)):
        ref, got = rows(one), rows(name, run)
        assert [r["rl/reward_mean"] for r in got] == [r["rl/reward_mean"] for r in ref], name
        assert [r["rl/reward_std"] for r in got] == [r["rl/reward_std"] for r in ref], name
        for k, (a, b) in enumerate(zip(ref, got)):
            tol = 1e-6 if k == 0 else 1e-4
            for key in ("loss", "grad_norm", "rl/kl", "rl/entropy"):
                assert _close(a[key], b[key], tol), (name, k + 1, key, a[key], b[key])
    asked = [json.loads(x) for x in (dumps["one"] / "rollouts.jsonl").read_text().splitlines()]
    assert {(s["prompt"], s["answer"]) for s in asked} <= {(f"{a} + {b} =", a + b) for a in range(3) for b in range(3)}
    straight, resumed = rows("fsdp2", "straight"), rows("fsdp2", "resumed")
    assert [r["step"] for r in resumed] == [5, 6]
    pairs = [(r["loss"], r["rl/reward_mean"]) for r in resumed]
    assert pairs == [(r["loss"], r["rl/reward_mean"]) for r in straight[4:]]
    samples = [json.loads(x) for x in (dumps["fsdp2"] / "rollouts.jsonl").read_text().splitlines()]
    fifth = [s for s in samples if s["step"] == 5]
    assert len(fifth) == 8 and fifth[:4] == fifth[4:]  # written by the straight run, then by the resumed one


BAD = {  # the arguments, and the start of the one line each gets before launch
    "group_size": (["--rl.group_size", "1"], "rl.group_size must be >= 2"),
    "not_importable": (["--rl.reward", "no_such_module:f"], "rl.reward: cannot import module 'no_such_module'"),
    "no_function": (["--rl.reward", "titanlite.rl.rewards:nothing"], "rl.reward: module 'titanlite.rl.rewards' has no"),
    "not_callable": (["--rl.reward", "titanlite.rl.rewards:_NUMBER"], "rl.reward: 'titanlite.rl.rewards:_NUMBER' is a"),
    "prompt_too_long": (["--training.seq_len", "16", "--rl.max_new_tokens", "12"],
                        "rl.prompts: built-in task row 1 has 7 tokens, more than training.seq_len - rl.max_new_tokens"),
    "prompts_not_jsonl": (["--rl.prompts", "nowhere.txt"], "rl.prompts: 'nowhere.txt' is not a .jsonl file"),
    "pp": (["--parallelism.pipeline_parallel_degree", "2"], "parallelism.pipeline_parallel_degree: rl.enable"),
    "cp": (["--parallelism.context_parallel_degree", "2"], "parallelism.context_parallel_degree: rl.enable generates"),
    "tp_sequence_parallel": (["--parallelism.tensor_parallel_degree", "2"], "parallelism.sequence_parallel: rl.enable"),
    "moe_under_tp": (["--model.name", "qwen3_moe", "--parallelism.tensor_parallel_degree", "2",
                      "--parallelism.sequence_parallel", "false", "--parallelism.expert_parallel_degree", "2"],
                     "parallelism.expert_parallel_degree: rl.enable generates one token at a time, which MoE"),
    "groups_over_dp": (["--training.global_batch_size", "4", "--training.local_batch_size", "2"],
                       "training.global_batch_size 4 must be rl.group_size 4 x a multiple of"),
    "lora_dropout": (["--lora.rank", "4", "--lora.dropout", "0.1"], "lora.dropout 0.1 with rl.enable: GRPO's ratio"),
    "preference_data": (["--data.format", "preference", "--data.tokenizer", "byte_chat", "--data.streaming", "false",
                         "--data.document_mask", "true"], "rl.enable: a GRPO run's data are its rollouts"),
}


def test_bad_rl_input_is_one_line_before_launch(tmp_path):
    """Each bad [rl] input is refused by the config load or the preflight (which run_train.sh runs
    before torchrun) with one line naming the key; the 2-rank cases are planned for 2 processes."""
    from titanlite.config import load as config_load
    from titanlite.errors import ConfigError
    from titanlite import rl
    from titanlite.preflight import preflight
    base = ["--model.flavor", "debugmodel", "--training.seq_len", "64", "--rl.enable", "true",
            "--training.global_batch_size", "8", "--training.local_batch_size", "4", "--job.dump_folder", str(tmp_path)]
    for name, (args, line) in BAD.items():
        with pytest.raises(ConfigError) as e:
            cfg, _ = config_load.load([*base, *args])
            rl.checked(cfg, preflight(cfg, 1 if name in ("group_size", "preference_data", "lora_dropout") or "reward" in args[0] or "prompt" in name else 2))
        assert str(e.value).startswith(line) and "\n" not in str(e.value), (name, str(e.value))


def test_a_rank_that_finished_feeds_on_without_changing_its_completions():
    """Under FSDP each rank runs the decode steps of the slowest (`everyone`, at most
    max_new_tokens): a rank whose rows all ended runs on, and its completions are those it
    generated alone."""
    import dataclasses
    from titanlite.generate import generate
    from titanlite.model_spec import get_model_spec
    spec = get_model_spec("llama3")
    model = spec.build(dataclasses.replace(spec.flavors["debugmodel"], max_seq_len=64))
    model.init_weights(0)
    prompts = [[5, 6, 7], [5, 6, 7]]
    first = generate(model, prompts, 6, temperature=1.0, seed=[3, 3])
    eos = [first[0].ids[1]]  # both rows end after 2 tokens
    alone = generate(model, prompts, 6, temperature=1.0, seed=[3, 3], eos_ids=eos)
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    together = generate(model, prompts, 6, temperature=1.0, seed=[3, 3], eos_ids=eos,
                        everyone=lambda running: len(calls) < 6)
    assert [g.ids for g in together] == [g.ids for g in alone] and len(alone[0].ids) == 2
    assert [g.finish for g in together] == [g.finish for g in alone] == ["eos", "eos"] and len(calls) == 6


def test_prompts_are_user_turns_and_a_chat_must_end_in_one(tmp_path):
    """A "prompt" row and a "messages" row render through the chat template with the generation
    prompt; a completion stops at the template's end of turn; a chat ending in an assistant turn
    is refused in one line, from rl.prompts or from a chat source (data.path's rows)."""
    import dataclasses
    from titanlite.data.tokenizer import build_tokenizer
    from titanlite.errors import ConfigError
    from titanlite.rl.prompts import load_prompts, stop_ids
    tok = build_tokenizer("byte_chat")
    good = tmp_path / "p.jsonl"
    good.write_text('{"messages": [{"role": "system", "content": "Be brief."}, '
                    '{"role": "user", "content": "2 + 2 ="}], "answer": "4"}\n{"prompt": "3 + 3 =", "answer": "6"}\n')
    p = load_prompts(str(good), tok, 0, 100)
    assert p.texts == ["2 + 2 =", "3 + 3 ="] and [r["answer"] for r in p.rows] == ["4", "6"]
    assert tok.decode(p.ids[1]) == "<s><|im_start|>user\n3 + 3 =<|im_end|>\n<|im_start|>assistant\n"
    assert tok.hf.convert_ids_to_tokens(stop_ids(tok)) == ["</s>", "<|im_end|>"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    with pytest.raises(ConfigError, match=r"^rl.prompts: .*bad.jsonl row 1: the chat.s last message has role assis"):
        load_prompts(str(bad), tok, 0, 100)
    # a chat source (data.format = "chat", rl.prompts empty): its rows, their "answer" where they have one
    from titanlite.config.data import Data
    chats = tmp_path / "chats.jsonl"
    chats.write_text(good.read_text().splitlines()[0] + '\n{"messages": [{"role": "user", "content": "3 + 3 ="}]}\n')
    source = Data(format="chat", path=str(chats), messages_field="messages", document_mask=True, tokenizer="byte_chat")
    p = load_prompts("", tok, 0, 100, source)
    assert p.texts == ["2 + 2 =", "3 + 3 ="] and p.rows[0] == {"messages": [{"role": "system", "content": "Be brief."},
                                                                             {"role": "user", "content": "2 + 2 ="}],
                                                                "answer": "4"} and "answer" not in p.rows[1]
    for path, line in ((bad, r"^data.path: .*bad.jsonl line 1: the chat.s last message has role assistant; a prompt"),
                       ("", r"^data.path: rl.enable with data.format = \"chat\" takes .* the built-in chat set has")):
        with pytest.raises(ConfigError, match=line):
            load_prompts("", tok, 0, 100, dataclasses.replace(source, path=str(path)))


GRPO_8B = ["--config", "llama_8b.toml", "--ngpu", "8", "--rl.enable", "true", "--rl.group_size", "8",
           "--rl.max_new_tokens", "1024", "--training.seq_len", "2048", "--training.global_batch_size", "64",
           "--training.local_batch_size", "8", "--checkpoint.interval", "100"]


def test_the_dry_run_times_a_grpo_step_as_rollout_plus_update(tmp_path, capsys):
    """Llama 3 8B on 8 H100 (docs/scaling.md): 64 completions per step, 8 per prompt, prompts of
    1024 tokens + 1024 new. On tp 8 (dp 1: 8 prompts per rank, float32 outside FSDP) each decode
    step reads this rank's weights and its cache share at HBM speed: (weights + cache) / bandwidth,
    summed over the steps by hand; on FSDP 8 (1 prompt per rank, bfloat16) every decode step
    waits for the gather of the whole model over NVLink instead."""
    from titanlite.dryrun.run import main
    bandwidth = 3.35e12 * 0.87  # the h100's HBM at the step-time model's memory-bound share (timing.FITTED.hbm)
    main([*GRPO_8B, "--parallelism.tensor_parallel_degree", "8", "--parallelism.sequence_parallel", "false",
          "--out", str(tmp_path / "tp.json")])
    rep = json.loads((tmp_path / "tp.json").read_text())
    g = rep["grpo"]
    assert g["prompts_per_rank"] == 8 and g["dtype"] == "float32"
    assert abs(g["weights_bytes"] / (8_030_261_248 * 4 / 8) - 1) < 1e-3  # an eighth of 8.03e9 fp32 parameters
    per_token = 32 * 2 * (8 // 8) * 128 * 4  # layers x (k, v) x this rank's kv heads x head dim x fp32
    cache = sum(8 * (1024 + j) * per_token for j in range(1, 1025))  # 8 rows at 1025..2048 tokens
    decode = 8 * (1024 * g["weights_bytes"] + cache) / bandwidth
    assert g["decode_s"] == pytest.approx(decode, rel=1e-9) and g["decode_gather_s"] == 0
    assert g["update_s"] == rep["predicted"]["step_s"]
    assert g["step_s"] == pytest.approx(g["rollout_s"] + g["update_s"], rel=1e-12)
    assert g["rollout_s"] == pytest.approx(g["prefill_s"] + g["decode_s"], rel=1e-12)
    assert "GRPO, per rollout batch on each rank: 8 prompt(s) x 8 completions" in capsys.readouterr().out

    main([*GRPO_8B, "--out", str(tmp_path / "fsdp.json")])
    g = json.loads((tmp_path / "fsdp.json").read_text())["grpo"]
    assert g["prompts_per_rank"] == 1 and g["dtype"] == "bfloat16"
    gather = 7 / 8 * g["weights_bytes"] / (450e9 * 0.80) + 33 * 10e-6  # ring over NVLink, a call per layer + 1
    assert g["decode_gather_s"] == pytest.approx(1024 * gather, rel=1e-9)
    assert g["decode_s"] == pytest.approx(g["decode_gather_s"], rel=1e-12)  # the gathers bound every step
    # a GRPO job the trainer would refuse is refused by the dry run too, not predicted
    with pytest.raises(SystemExit):
        main([*GRPO_8B, "--training.global_batch_size", "72", "--training.local_batch_size", "9"])
    assert capsys.readouterr().err == ("titanlite: error: training.global_batch_size 72 must be rl.group_size 8 x a "
                                       "multiple of the data-parallel degree 8 (each rank generates whole groups)\n")


def test_rollouts_generate_in_the_steps_mixed_precision(monkeypatch):
    """Without FSDP (TP only, one device) the step's autocast gives the mixed precision: the rollouts
    are generated under it too, not in float32 (a rollout's dtype would otherwise depend on the
    layout, FSDP's casting its weights for generation as for training)."""
    import dataclasses
    from titanlite.config.rl import RL as RLConfig
    from titanlite.model_spec import get_model_spec
    from titanlite.rl import rollout
    from titanlite.rl.prompts import Prompts
    spec = get_model_spec("llama3")
    model = spec.build(dataclasses.replace(spec.flavors["debugmodel"], max_seq_len=64))
    model.init_weights(0)
    dtypes = []
    model.output.register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
    step = SimpleNamespace(model=model, autocast=torch.autocast("cpu", dtype=torch.bfloat16))
    monkeypatch.setattr(rollout.dist, "get_world_size", lambda: 1)
    r = RLConfig(enable=True, group_size=2, max_new_tokens=3)
    rolls = rollout.Rollouts(r, Prompts([{}], ["x"], [[5, 6, 7]]), lambda ids: "", [], None, step, 0, 64, 2, 2, 0, 1,
                             None, torch.device("cpu"), "", lambda n: False)
    assert [len(ids) for _, ids, _ in rolls._generate(0, [0])] == [3, 3]
    assert dtypes == [torch.bfloat16] * 3
