"""docs/fork_a_model.md as written: every code block, in order, in a temporary copy of the repository.

`cp -r` copies a family, the `name=` block names the copy, each diff (`--- path`, then `-`, `+` and
context lines) is applied where its old lines occur exactly once, each `./run_train.sh` line runs
with a dump folder and smaller batches added, a `text` block after a run is the refusal it must end
with (exit 2), and the gradient-parity commands run together in one launch."""

import os
import re
import shlex
import shutil
import subprocess
import sys
import time

from harness import REPO, Run

GUIDE = REPO / "docs" / "fork_a_model.md"
SMALL = ["--training.seq_len", "64", "--training.local_batch_size", "8", "--metrics.log_freq", "1",
         "--metrics.enable_tensorboard", "false", "--data.holdout_fraction", "0.0", "--lr_scheduler.warmup_steps", "3"]


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block, its indentation (a list item's) removed."""
    found = re.findall(r"^( *)```(\w*)\n(.*?)^\1```$", text, re.M | re.S)
    return [(lang, "".join(line[len(indent):] for line in body.splitlines(keepends=True)))
            for indent, lang, body in found]


def apply_diff(repo, body: str) -> None:
    header, *lines = body.splitlines()
    assert header.startswith("--- "), f"a diff names its file first: {header!r}"
    path = repo / header[4:]
    old = "".join(line[1:] + "\n" for line in lines if line[:1] in " -")
    new = "".join(line[1:] + "\n" for line in lines if line[:1] in " +")
    text = path.read_text()
    starts = [m.start() for m in re.finditer(re.escape(old), text, re.M) if m.start() == 0 or text[m.start() - 1] == "\n"]
    assert len(starts) == 1, f"{header[4:]}: the diff's old lines occur {len(starts)} times:\n{old}"
    path.write_text(text[:starts[0]] + new + text[starts[0] + len(old):])


def env(repo) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": str(repo)}


def run_train(repo, dump, line: str, *extra: str) -> Run:
    start = time.perf_counter()
    words = shlex.split(line)
    assigned = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S*", w))
    command = [w for w in words if w not in {f"{k}={v}" for k, v in assigned.items()}]
    assert command[0] == "./run_train.sh", line
    proc = subprocess.run(["bash", "run_train.sh", *command[1:], "--job.dump_folder", str(dump), *SMALL, *extra],
                          capture_output=True, text=True, env=env(repo) | {"NGPU": "1"} | assigned, cwd=repo, timeout=300)
    print(f"{time.perf_counter() - start:.1f} s: {line}")  # pytest -s shows where the time goes
    return Run(proc.returncode, proc.stdout + proc.stderr, dump)


def checkpoint_is_the_forks(repo, dump) -> None:
    """The fork's checkpoint records its family: llama3, with the very same parameter names and
    shapes, is refused on the ranks (the preflight, skipped here, refuses it too; in process in
    test_checkpoint), and the fork resumes it, here on one rank from its two."""
    saved = dump / "checkpoint" / "step-30"
    refused = run_train(repo, dump, "./run_train.sh --skip-preflight --model.name llama3 --training.steps 31",
                        "--checkpoint.enable")
    line = (f"titanlite: error: {saved} holds a checkpoint of model 'my_llama', not of 'llama3' (model.name): "
            "another model's weights would load into it")
    assert refused.returncode == 2 and line in refused.output.strip().splitlines()[-1], refused.output[-2000:]
    resumed = run_train(repo, dump, "./run_train.sh --model.name my_llama --training.steps 31", "--checkpoint.enable")
    assert resumed.returncode == 0 and f"resumed from {saved}" in resumed.output, resumed.output[-2000:]
    assert len(resumed.losses) == 31  # the first run's 30 rows and the resumed step's


def test_the_fork_guide_runs_as_written(tmp_path):
    repo = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("titanlite", "models", "train_configs"):
        shutil.copytree(REPO / folder, repo / folder, ignore=ignore, symlinks=True)  # titanlite/models links to models/
    shutil.copy2(REPO / "run_train.sh", repo / "run_train.sh")
    (repo / "tests").mkdir()
    shutil.copy2(REPO / "tests" / "grad_parity.py", repo / "tests" / "grad_parity.py")

    guide = blocks(GUIDE.read_text())
    copied, runs, parity = [], [], []
    for i, (lang, body) in enumerate(guide):
        if lang == "bash":
            for line in body.strip().splitlines():
                if line.startswith("cp -r "):
                    _, _, source, fork = line.split()
                    shutil.copytree(repo / source, repo / fork, ignore=ignore)
                    copied.append(fork.rpartition("/")[2])
                    if len(copied) > 1:  # later copies are named "as above"
                        init = repo / fork / "__init__.py"
                        init.write_text(init.read_text().replace('name="llama3"', f'name="{copied[-1]}"'))
                elif "run_train.sh" in line:
                    # the first run (the GELU fork) also saves its last step, for the checks below
                    run = run_train(repo, tmp_path / f"run-{len(runs)}", line,
                                    *(() if runs else ("--checkpoint.enable", "--checkpoint.interval", "30")))
                    refusal = guide[i + 1][1].strip() if i + 1 < len(guide) and guide[i + 1][0] == "text" else None
                    if refusal is None:
                        assert run.returncode == 0, run.output[-4000:]
                        assert len(run.losses) == int(re.search(r"--training.steps (\d+)", line)[1]), run.output[-2000:]
                    else:  # the refusal as the guide prints it, before any rank started
                        assert run.returncode == 2 and run.output.strip().splitlines()[-1] == refusal, run.output[-3000:]
                        assert not (run.dump / "metrics.jsonl").exists()
                    runs.append((line, run))
                    if len(runs) == 1:
                        checkpoint_is_the_forks(repo, run.dump)
                elif "grad_parity.py" in line:
                    parity.append(shlex.split(line))
                else:
                    raise AssertionError(f"the test does not know how to run this line of the guide: {line}")
        elif lang == "python" and 'ModelSpec(name="' in body:
            init = repo / "models" / copied[-1] / "__init__.py"
            init.write_text(init.read_text().replace('name="llama3"', re.search(r'name="\w+"', body)[0]))
        elif lang == "diff":
            apply_diff(repo, body)
    assert copied == ["my_llama", "my_moe"] and len(runs) == 3 and len(parity) == 2

    # the first run (SiLU -> GELU at tp 2) trained: its loss fell
    losses = runs[0][1].losses
    assert re.search(r"titanlite: my_llama debugmodel", runs[0][1].output), runs[0][1].output[-2000:]
    assert max(losses[-5:]) < 0.6 * losses[0], losses

    # every gradient of one step at the guide's layouts against the unsharded model, in one launch:
    # MODEL LAYOUT [+ LAYOUT model=OTHER ...]
    def split(words):  # launcher and script, model, layout
        at = next(i for i, w in enumerate(words) if w.endswith("grad_parity.py"))
        return words[:at + 1], words[at + 1], words[at + 2:]

    command, model, layout = split(parity[0])
    words = [*command, model, *layout]
    for other in parity[1:]:
        assert split(other)[0] == command, other  # one launch: the same number of ranks
        words += ["+", *split(other)[2], f"model={split(other)[1]}"]
    proc = subprocess.run([sys.executable if w == "python" else w for w in words], capture_output=True, text=True,
                          env=env(repo), cwd=repo, timeout=300)
    assert proc.returncode == 0 and proc.stdout.count("worst relative diff") == 2 * len(parity), \
        proc.stdout[-3000:] + proc.stderr[-3000:]

    # the edits took effect: with the same seeded weights, the GELU + QK-norm fork's logits differ from llama3's
    probe = """
import torch
import titanlite.models.llama3 as base, titanlite.models.my_llama as fork
args = base.flavors["debugmodel"].__class__(**{**base.flavors["debugmodel"].__dict__, "max_seq_len": 16})
a, b = base.Transformer(args), fork.Transformer(args)
a.init_weights(0); b.init_weights(0)
shared = a.state_dict().keys() & b.state_dict().keys()
assert b.state_dict().keys() - shared == {f"layers.{i}.attention.{n}_norm.weight" for i in range(4) for n in "qk"}
assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in shared)
tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
print((a(tokens) - b(tokens)).abs().max().item())
"""
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env(repo), cwd=repo,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) > 1e-4, proc.stdout
