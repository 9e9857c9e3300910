"""titanlite.eval: request construction against lm-eval's own helpers, the even split of requests
over data-parallel ranks, task files' bad rows, and `python -m titanlite.eval` against lm-eval's
`hf` model on the exported transformers folder (every request's log-likelihood, every score)."""

import dataclasses
import json
import os
import re

import pytest
import torch

import titanlite
from titanlite.errors import ConfigError
from titanlite.eval.requests import continuation, rolling
from titanlite.eval.score import _batches
from titanlite.eval.tasks import read_task
from titanlite.model_spec import get_model_spec


def test_requests_split_and_windows():
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    for n, degree, size in [(21, 2, 2), (7, 4, 3), (3, 4, 2), (0, 2, 1), (28, 2, 5)]:
        ranks = [_batches(n, r, degree, size) for r in range(degree)]
        assert len({len(b) for b in ranks}) == 1  # every rank runs as many forwards
        assert sorted(i for b in ranks for batch in b for i in batch) == list(range(n))
    for length, window in [(1, 4), (4, 4), (10, 4), (9, 3)]:
        ids = list(range(10, 10 + length))
        theirs = [make_disjoint_window(w) for w in get_rolling_token_windows(ids, 1, window, 1)]
        ours = rolling(ids, 1, window, 0)
        assert [(r.tokens[:-r.n_target], r.tokens[-r.n_target:]) for r in ours] == \
            [(ctx, pred) for ctx, pred in theirs]
    r = continuation(lambda s: list(s.encode()), "ab ", "c", [], 3, 0)
    assert (r.tokens, r.n_target) == ([97, 98, 32, 99], 2)  # the context's space moves to the continuation


def test_only_the_eval_command_imports_lm_eval():
    """lm-eval is the `eval` extra's: no module training imports may import it."""
    import pathlib
    import re

    root = pathlib.Path(titanlite.__file__).parent
    users = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                   if re.search(r"^\s*(import lm_eval|from lm_eval)", p.read_text(), re.M))
    # the model class, the command inside run(), and the loop's lm-eval task names
    assert users == ["eval/__main__.py", "eval/harness.py", "eval/lmtasks.py"]
    # ... which training imports only inside load_tasks, where eval.tasks names an lm-eval task
    lazy = {str(p.relative_to(root)): re.findall(r"^(\s*)(?:from titanlite.eval.lmtasks|import titanlite.eval.lmtasks)",
                                                 p.read_text(), re.M) for p in root.rglob("*.py")}
    assert {k: v for k, v in lazy.items() if v} == {"eval/score.py": [" " * 12]}


def test_task_rows_refused(tmp_path, monkeypatch):
    from titanlite.config.eval import Eval, check_eval

    with monkeypatch.context() as m:  # an lm-eval task name where lm-eval is not installed
        m.setattr("importlib.util.find_spec", lambda name: None)
        with pytest.raises(ConfigError, match="'hellaswag' is neither a built-in task .* lm-eval .* is not installed; "
                                              "pip install"):
            check_eval(Eval(tasks=["hellaswag"]))
    cases = [('{"context": "a", "choices": ["b", "c"], "gold": 2}', "row 1: gold 2 is not an index of its 2 choices"),
             ('{"text": "a"}\n{"txt": "b"}', "row 2: a bpb task's row needs the keys text"),
             ('{"prompt": "a", "answer": "b"}\nnot json', "row 2 is not JSON"),
             ('{"question": "a"}', "row 1: a row needs context/choices/gold")]
    for text, message in cases:
        (tmp_path / "t.jsonl").write_text(text + "\n")
        with pytest.raises(ConfigError, match=message):
            read_task(tmp_path / "t.jsonl")


MC_YAML = """task: tl_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
ROLLING_YAML = """task: tl_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def test_lm_eval_matches_hf(tmp_path, monkeypatch):
    """A local multiple-choice task and a local rolling-perplexity task (texts past the model's 64
    positions: several windows) through titanlite's model class on a step folder and through
    lm-eval's hf model on its transformers export: every request's log-likelihood within 1e-5."""
    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(key, "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from titanlite.checkpoint.folder import write_model_checkpoint
    from titanlite.data.tokenizer import byte_chat_tokenizer

    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors["debugmodel"], dim=64, n_heads=4, n_kv_heads=2, multiple_of=32,
                               max_seq_len=64, vocab_size=byte_chat_tokenizer().vocab_size)
    model = spec.build(args)
    model.init_weights(3)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4)  # logits that differ from token to token
    chat = byte_chat_tokenizer()
    write_model_checkpoint(tmp_path / "step-1", model.state_dict(), "llama3", args)
    titanlite.write_hf(tmp_path / "hf", spec.hf.to_hf(model.state_dict(), args), spec.hf.config_to_hf(args, torch.float32))
    chat.hf.save_pretrained(tmp_path / "hf")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    rows = [{"context": f"Question {i}: what is {i} + {i}?\nAnswer:", "choices": [f" {2 * i}", f" {i}", " none"],
             "gold": 0} for i in range(6)] + [{"context": "", "choices": ["yes", "no"], "gold": 1}]
    (tasks / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "ppl.jsonl").write_text("".join(json.dumps({"text": "def f(x):\n    return x\n" * i}) + "\n"
                                             for i in (1, 3, 7)))
    (tasks / "tl_mc.yaml").write_text(MC_YAML.format(data=tasks / "mc.jsonl"))
    (tasks / "tl_ppl.yaml").write_text(ROLLING_YAML.format(data=tasks / "ppl.jsonl"))
    (tasks / "tl_gen.yaml").write_text(MC_YAML.replace("tl_mc", "tl_gen").replace(
        "multiple_choice", "generate_until").format(data=tasks / "mc.jsonl"))
    # a task whose data set is on the hub only
    (tasks / "tl_hub.yaml").write_text(ROLLING_YAML.replace("tl_ppl", "tl_hub").replace(
        "dataset_path: json", "dataset_path: someone/not_here").format(data="unused"))
    manager = TaskManager(include_path=str(tasks))  # one for every run here: it indexes lm-eval's tasks
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=str(tmp_path / "hf"), dtype="float32", device="cpu")
    theirs = lm_eval.simple_evaluate(model=hf, tasks=["tl_mc", "tl_ppl"], task_manager=manager, log_samples=True)
    from titanlite.eval.__main__ import parse, run

    ours = run(parse([str(tmp_path / "step-1"), "--tasks", "tl_mc,tl_ppl", "--include_path", str(tasks),
                      "--tokenizer", str(tmp_path / "hf"), "--batch_size", "3"]), manager)
    # the same tasks named in eval.tasks, scored by the training loop's evaluator (one process, the
    # model's context as training.seq_len): lm-eval's metrics, equal to the command's
    from titanlite.config.eval import Eval
    from titanlite.data.tokenizer import build_tokenizer
    from titanlite.eval import lmtasks
    from titanlite.eval.score import Evaluator, load_tasks
    from titanlite.loss import token_logprobs

    monkeypatch.setattr(lmtasks, "_manager", lambda include_path, defaults: manager)
    monkeypatch.setattr("titanlite.eval.score.dist.all_reduce", lambda *a, **k: None)
    ev = Evaluator(Eval(tasks=["tl_mc", "tl_ppl"], include_path=str(tasks), limit=0, batch_size=3),
                   build_tokenizer(str(tmp_path / "hf")), 64, 0, 1, None)
    loop = ev([model], lambda b: b, lambda b: token_logprobs(model(b["input_ids"]), b["labels"]), torch.device("cpu"))
    for name, message in [("no_such_task", "'no_such_task' is not a built-in task, a .jsonl task file or an lm-eval"),
                          ("tl_gen", "lm-eval task 'tl_gen' is a generate_until task, which the training loop")]:
        with pytest.raises(ConfigError, match=message):
            load_tasks(Eval(tasks=[name]))
    worst = 0.0
    for task in ("tl_mc", "tl_ppl"):
        a, b = theirs["samples"][task], ours["samples"][task]
        assert len(a) == len(b) == (7 if task == "tl_mc" else 3)
        for x, y in zip(a, b):
            for rx, ry in zip(x["resps"], y["resps"], strict=True):
                llx, lly = (rx[0][0], ry[0][0]) if task == "tl_mc" else (rx[0], ry[0])
                worst = max(worst, abs(llx - lly) / abs(llx))
                assert abs(llx - lly) <= 1e-5 * abs(llx), (task, llx, lly)
        for metric, value in theirs["results"][task].items():
            if isinstance(value, float) and "stderr" not in metric:
                assert ours["results"][task][metric] == pytest.approx(value, rel=1e-5), (task, metric)
                assert loop[f"eval/{task}/{metric.removesuffix(',none')}"] == pytest.approx(value, rel=1e-5), metric
        for metric in ("acc,none", "acc_norm,none") if task == "tl_mc" else ():
            assert ours["results"][task][metric] == theirs["results"][task][metric] == loop[f"eval/{task}/{metric[:-5]}"]
    # generate_until: greedy up to a stop string, as transformers generates
    from lm_eval.api.instance import Instance

    from titanlite.eval.harness import TitanliteLM

    prompts = ["def f(x):\n    return", "Question 3: what is"]
    asks = [Instance("generate_until", {}, (p, {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}), i)
            for i, p in enumerate(prompts)]
    tl = TitanliteLM(str(tmp_path / "step-1"), tokenizer=str(tmp_path / "hf"))
    texts = tl.generate_until(asks)
    assert texts == hf.generate_until(asks) and all(texts)
    # loglikelihood's greedy flag, as hf gives it: true for a context's own greedy next character
    # (random weights mostly pick bytes that are not text: contexts whose pick is a printable one)
    from titanlite.layers.attention import AttnContext

    nexts = [(c, int(tl.model(torch.tensor([tl.tokenizer.encode(c)]), AttnContext())[0, -1].argmax()))
             for c in (f"Question {i}:" for i in range(30))]
    greedy = [(c, chr(t)) for c, t in nexts if 32 <= t < 127][:2]
    asks = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(
        [*greedy, (prompts[0], " x"), ("", "def"), (greedy[0][0], greedy[0][1] + "\u2603")])]
    mine, hfs = tl.loglikelihood(asks), hf.loglikelihood(asks)
    assert [g for _, g in mine] == [g for _, g in hfs] == [True] * len(greedy) + [False] * 3
    # (a greedy character's log-likelihood is near 0: within 1e-5 absolute, about the float32
    # resolution of these logits, which reach the tens)
    assert [ll for ll, _ in mine] == pytest.approx([ll for ll, _ in hfs], rel=1e-5, abs=1e-5)
    print(f"worst relative log-likelihood difference {worst:.2e}; hf {theirs['results']}; titanlite {ours['results']}")
    with pytest.raises(ConfigError, match="no_such_task: not an lm-eval task here"):
        run(parse([str(tmp_path / "step-1"), "--tasks", "no_such_task"]), manager)
    # the hub-only task: refused in one line, no wait on the network
    with pytest.raises(ConfigError, match="a task's data is not on this machine"):
        run(parse([str(tmp_path / "step-1"), "--tasks", "tl_hub", "--include_path", str(tasks)]), manager)


def test_in_loop_scores_add_up_over_ranks(monkeypatch):
    """Evaluator on 'rank 0 of 2' and 'rank 1 of 2' (the all-reduce left out) sum to the one-process
    values: log-likelihoods of a multiple-choice task and exact match over 5 prompts (3 and 2),
    whose answers are the model's own greedy first lines for prompts 0, 1, 2 and wrong for 3, 4;
    exact match the pipeline's way too (whole rows each step, no cache), the same."""
    from titanlite.config.eval import Eval
    from titanlite.data.tokenizer import ByteTokenizer
    from titanlite.eval.requests import first_line, task_requests
    from titanlite.eval.score import Evaluator
    from titanlite.eval.tasks import Task
    from titanlite.generate import generate

    monkeypatch.setattr("titanlite.eval.score.dist.all_reduce", lambda *a, **k: None)
    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors["debugmodel"], dim=64, n_heads=4, n_kv_heads=2, multiple_of=32,
                               max_seq_len=64)
    model = spec.build(args)
    model.init_weights(5)
    tok, steps = ByteTokenizer(), 6
    prompts = [f"def f{i}(" for i in range(5)]
    gens = generate(model.eval(), [[tok.eos_id, *tok.encode(p)] for p in prompts], max_new_tokens=steps, context=64)
    answers = [first_line(tok.decode(g.ids)) if i < 3 else "\u2603" for i, g in enumerate(gens)]
    exact = Task("sig", "exact", [{"prompt": p, "answer": a} for p, a in zip(prompts, answers)])
    choice = Task("mc", "choice", [{"context": f"x = {i}", "choices": [" +", " -", "\n"], "gold": i % 3}
                                   for i in range(5)])

    def logits_of(batch):
        from titanlite.loss import token_logprobs
        return token_logprobs(model(batch["input_ids"]), batch["labels"])

    def rows(batch, fn, dtype):  # one pipeline stage: the model's logits of the whole rows, no cache
        return fn(model(batch["input_ids"]), batch["labels"]).to(dtype)

    def scores(rank, degree):
        ev = Evaluator(Eval(tasks=[], batch_size=2, max_new_tokens=steps), tok, 64, rank, degree, None)
        lls = ev.log_likelihoods(task_requests(choice, tok.encode, tok.eos_id, 64), lambda b: b, logits_of,
                                 torch.device("cpu"))
        cpu = torch.device("cpu")
        return lls, ev.exact_match(exact, model, cpu), ev.exact_match_staged(exact, rows, lambda b: b, cpu)

    one, (a, b) = scores(0, 1), (scores(0, 2), scores(1, 2))
    for k in (1, 2):  # generate's cached steps, then the pipeline's whole rows: the same greedy tokens
        assert one[k] == 0.6 and a[k] + b[k] == pytest.approx(0.6)  # 3 of 5: the right answers, each counted once
        assert a[k] == pytest.approx(0.4) and b[k] == pytest.approx(0.2)
    torch.testing.assert_close(a[0] + b[0], one[0], rtol=1e-6, atol=0)
    assert (a[0] != 0).sum() == 8 and (b[0] != 0).sum() == 7  # 15 requests: 8 and 7


def test_builtin_tasks_are_well_formed():
    """Every built-in row passes the task files' checks; the wrong choices of stdlib_which are right
    ones elsewhere (no kind of name wins by itself); stdlib_def's choices differ in order only."""
    from collections import Counter

    from titanlite.config.eval import BUILTIN_TASKS
    from titanlite.eval import builtin
    from titanlite.eval.tasks import _check_row

    tasks = {name: builtin.make(name) for name in BUILTIN_TASKS}
    for task in tasks.values():
        assert len(task.rows) > 400
        for i, row in enumerate(task.rows):
            _check_row(row, task.kind, f"{task.name} row {i}")
    rows = tasks["stdlib_which"].rows
    golds = {r["choices"][r["gold"]] for r in rows}
    assert len({c for r in rows for c in r["choices"]} - golds) <= len(rows) // 100  # (the rows skipped)
    assert Counter(r["gold"] for r in rows).most_common()[-1][1] > len(rows) // 5  # gold positions spread
    for r in tasks["stdlib_def"].rows:
        assert len({"".join(sorted(c)) for c in r["choices"]}) == 1 and len(set(r["choices"])) == 4


def test_the_dry_run_reports_an_evaluation_s_peak(tmp_path, capsys, monkeypatch):
    """[eval] on: the dry run traces one forward-only evaluation batch (eval.batch_size x seq_len,
    no_grad, after zero_grad) beside the step. On the debug model it holds less than the training
    step's peak, and at least the weights, the optimizer state and the batch's float32 logits
    (B x T x vocab 512 x 4 bytes), more with more rows. Llama 3 8B on 8 GPUs: its log-probabilities
    taken in chunks as the training loss's, 8 x 8,192 rows hold 30.6 GiB (the bf16 logits, 15.7
    GiB, and one chunk's float32; 91.9 GiB when the whole batch's float32 log-softmax was held at
    once), refused in one line by run_train.sh's preflight on a 24 GiB device; 36 rows (88.9 GiB)
    are refused by the dry run on H100s."""
    from titanlite.config import load
    from titanlite.dryrun import run
    from titanlite.dryrun.run import main

    def roles(batch: int) -> dict:
        main(["--config", "debug_model.toml", "--eval.tasks", "stdlib_which", "--eval.batch_size", str(batch),
              "--out", str(tmp_path / "r.json")])
        return json.loads((tmp_path / "r.json").read_text())["roles"][0]

    eight, sixteen = roles(8), roles(16)
    gib = 2**30
    resident = (eight["memory_gib"]["parameters"] + eight["memory_gib"]["optimizer"]) * gib
    logits = 8 * 256 * 512 * 4
    assert resident + logits <= eight["eval_peak_gib"] * gib < eight["memory_gib"]["peak"] * gib
    assert (sixteen["eval_peak_gib"] - eight["eval_peak_gib"]) * gib >= logits
    assert "evaluation ([eval], 8 x 256 tokens, forward only): peak" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--config", "llama_8b.toml", "--ngpu", "8", "--eval.tasks", "stdlib_which", "--eval.batch_size", "36"])
    err = capsys.readouterr().err
    assert re.fullmatch(r"titanlite: error: an evaluation's per-rank peak \d+\.\d GiB \(eval.batch_size 36 x "
                        r"training.seq_len 8192\) exceeds the h100's 79.6 GiB; use a smaller eval.batch_size\n", err)
    monkeypatch.setattr(run, "device_limit_gib", lambda local_ranks: (24.0, "a 24 GiB device's"))
    cfg, _ = load.load(["--config", "llama_8b.toml", "--eval.tasks", "stdlib_which", "--training.device", "cuda"])
    with pytest.raises(ConfigError, match=r"^an evaluation's estimated per-rank peak 30\.\d\d GiB \(eval.batch_size 8 "
                       r"x training.seq_len 8192\) exceeds 24.00 GiB \(a 24 GiB device's\) by more than 10%; use a "
                       r"smaller eval.batch_size"):
        run.check_memory(cfg, 8, 8, 8_030_261_248)
