"""Preference optimization on every layout: one gloo launch (tests/lora_layouts.py) runs DPO with
LoRA (the reference: the adapters off; preference.sft_weight 0.5) on FSDP 2 with two micro-batches
per step (saving at step 5), FSDP 2 resumed from step 5, TP 2, CP 2, EP 2 (qwen3_moe) and PP 2 (two
micro-batches per step), and full fine-tuning on FSDP 2 with a frozen reference copy
(preference.reference = model) and with the reference's sums precomputed (precomputed), each
straight and resumed from step 5. Every run's losses equal one process's over 10 steps (1e-6 at
step 1, 1e-4 after), resumed runs are bitwise the straight ones, step 1's reward margins are 0
(policy = reference) and without the SFT term its loss is ln 2, and the held-out pairs' metrics
(validation) are one process's."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from harness import TINY, assert_parity, reference, spawn_ranks

REPO = Path(__file__).resolve().parent.parent


def write_pairs(path: Path, n: int) -> Path:
    """n short pairs in TRL's conversational form: the chosen answer names the question's number."""
    rows = [{"prompt": [{"role": "user", "content": f"Q{i}?"}],
             "chosen": [{"role": "assistant", "content": f"A{i} yes."}],
             "rejected": [{"role": "assistant", "content": f"no {i * 7 % 13}"}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(dump: Path, run: str | None = None, key: str = "loss") -> list[dict]:
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if key in r and (run is None or r["run"] == run)]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference")
    data = write_pairs(root / "pairs.jsonl", 200)
    base = [*TINY, "--training.seq_len", "128", "--training.global_batch_size", "8", "--data.path", str(data),
            "--data.format", "preference", "--data.tokenizer", "byte_chat", "--data.document_mask", "true",
            "--preference.beta", "0.5", "--optimizer.lr", "1e-3", "--data.holdout_fraction", "0.1",
            "--validation.freq", "5", "--validation.steps", "1"]
    # the LoRA runs with the SFT term, whose weight is over the step's global batch
    lora = [*base, "--lora.rank", "4", "--lora.target_modules", "wq,wv,wo", "--preference.sft_weight", "0.5"]
    moe = [*lora, "--model.name", "qwen3_moe"]
    full = [*base, "--preference.reference", "model", "--optimizer.lr", "1e-4"]
    pre = [*full, "--preference.reference", "precomputed"]
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "5"]
    runs = {
        "fsdp2": [*lora, "--training.local_batch_size", "2", *ckpt, "--job.run_name", "straight"],
        "resumed": [*lora, "--training.local_batch_size", "2", *ckpt, "--job.run_name", "resumed",
                    "--checkpoint.load_step", "5"],
        "tp2": [*lora, "--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"],
        "cp2": [*lora, "--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2"],
        "ep2": [*moe, "--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"],
        "pp2": [*lora, "--training.local_batch_size", "4", "--parallelism.pipeline_parallel_degree", "2",
                "--parallelism.pipeline_parallel_microbatch_size", "2"],
        "full_fsdp2": [*full, "--training.local_batch_size", "4", *ckpt, "--job.run_name", "straight"],
        "full_resumed": [*full, "--training.local_batch_size", "4", *ckpt, "--job.run_name", "resumed",
                         "--checkpoint.load_step", "5"],
        # the reference's sums computed before step 1 (each rank half the samples, in two micro-batches)
        "pre_fsdp2": [*pre, "--training.local_batch_size", "2", *ckpt, "--job.run_name", "straight"],
        "pre_resumed": [*pre, "--training.local_batch_size", "2", *ckpt, "--job.run_name", "resumed",
                        "--checkpoint.load_step", "5"],
    }
    shared = {"resumed": "fsdp2", "full_resumed": "full_fsdp2", "pre_resumed": "pre_fsdp2"}
    dumps = {name: root / shared.get(name, name) for name in runs}
    argv = " + ".join(" ".join([*args, "--job.dump_folder", str(dumps[name])]) for name, args in runs.items())
    codes, output = spawn_ranks(2, [str(REPO / "tests" / "lora_layouts.py"), *argv.split()], timeout=900)
    assert codes == [0, 0], output[-6000:]
    refs = {"llama3": reference([*lora, "--training.local_batch_size", "8"]),
            "qwen3_moe": reference([*moe, "--training.local_batch_size", "8"]),
            "full": reference([*full, "--training.local_batch_size", "8"]),
            "pre": reference([*pre, "--training.local_batch_size", "8"])}
    return dict(runs=runs, dumps=dumps, output=output, refs=refs)


def test_every_layout_matches_one_process(layouts):
    out = layouts["output"]
    for i, name in enumerate(layouts["runs"]):
        lines = re.findall(rf"rank \d run {i}: (.*)", out)
        assert len(lines) == 2 and all("optimizer exact: True" in x and "frozen unchanged: True" in x
                                       or x == "full fine-tuning" for x in lines), (name, lines, out[-4000:])
    refs = {"ep2": "qwen3_moe", "full_fsdp2": "full", "pre_fsdp2": "full"}
    # one process: the precomputed reference's losses are the frozen copy's
    assert_parity(layouts["refs"]["full"].losses, layouts["refs"]["pre"].losses)
    for name in ("fsdp2", "tp2", "cp2", "ep2", "pp2", "full_fsdp2", "pre_fsdp2"):
        ref = layouts["refs"][refs.get(name, "llama3")]
        got = _rows(layouts["dumps"][name], "straight" if name.endswith("fsdp2") else None)
        assert_parity(ref.losses, [r["loss"] for r in got])
        assert got[0]["rewards/margins"] == 0.0  # the policy is its reference
        if name.startswith(("full", "pre")):  # the LoRA runs' losses have the SFT term
            assert got[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
        diffs = [abs(a - r["loss"]) / a for a, r in zip(ref.losses, got)]
        print(f"{name}: first-step loss rel. diff {diffs[0]:.1e}, worst of {len(diffs)} steps {max(diffs):.1e}")
    assert max(r["rewards/accuracies"] for r in _rows(layouts["dumps"]["fsdp2"], "straight")) > 0.5  # it learns


def test_held_out_pairs_are_validated_with_trls_metrics_on_every_layout(layouts):
    """Validation at steps 5 and 10 on the held-out pairs: the loss and TRL's metrics (val_rewards/...)
    equal one process's on each layout."""
    names = ("val_loss", "val_rewards/accuracies", "val_rewards/margins", "val_logps/chosen")
    for name in ("tp2", "cp2", "pp2"):
        ref = _rows(layouts["refs"]["llama3"].dump, key="val_loss")
        got = _rows(layouts["dumps"][name], key="val_loss")
        assert [r["step"] for r in ref] == [r["step"] for r in got] == [5, 10] and ref[-1]["val_rewards/margins"] > 0
        for a, b in zip(ref, got):
            for n in names:
                assert b[n] == pytest.approx(a[n], rel=1e-4, abs=1e-6), (name, n, a[n], b[n])


def test_a_resumed_run_is_bitwise_the_straight_one(layouts):
    """LoRA (the reference: adapters off) and full fine-tuning (the frozen copy, or the precomputed
    sums, saved with each checkpoint): steps 6-10 after a resume from step 5 are the straight run's,
    bit for bit."""
    for dump in (layouts["dumps"]["fsdp2"], layouts["dumps"]["full_fsdp2"], layouts["dumps"]["pre_fsdp2"]):
        straight, resumed = _rows(dump, "straight"), _rows(dump, "resumed")
        assert [r["step"] for r in resumed] == list(range(6, 11))
        assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[5:]]
        assert [r["rewards/margins"] for r in resumed] == [r["rewards/margins"] for r in straight[5:]]
