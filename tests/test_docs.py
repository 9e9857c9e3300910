"""The documentation runs (tests/doc_commands.py says where its commands come from and how a doc
marks one that cannot run here).

How a command runs here, as written:
- `./run_train.sh ...` (any NGPU/NNODES): its preflight alone, in this process, at NGPU x NNODES
  ranks (1 without NGPU, as on a machine without CUDA); `--print-config` and `--help` print;
- `python -m titanlite.dryrun --config X --ngpu N`: the dry run itself for the configs in CHEAP,
  else its preflight alone; `python -m titanlite.plan` and `titanlite.tools.estimate`: the preflight;
- the walk-throughs (WALKS: README's fork, docs/post_training.md) for real, in their own order in one
  copy of the repository, each training run shortened by the documented smoke override
  `--training.steps 2` (and the step folders it names to the step that writes).
The predicted figures beside their commands (FIGURES) are checked against what the command prints.
TITANLITE_DOCS_SLOW=1 also runs the planner searches and the 405B dry run whose figures the docs
give (minutes of CPU: not in the suite).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from doc_commands import REPO, Command, commands, sources

from titanlite.config import load as config_load
from titanlite.config.job import JobConfig
from titanlite.preflight import preflight

SLOW = os.environ.get("TITANLITE_DOCS_SLOW") == "1"
CHEAP = {"debug_model.toml", "llama3_100m.toml", "qwen3_debug.toml", "llama_1b.toml", "llama_3b.toml",
         "llama_8b.toml", "qwen3_0.6b.toml", "qwen3_8b.toml"}
# the walk-throughs: a doc's every runnable command, or the fenced block holding the anchor command
WALKS = {"README.md": "cp -r models/llama3 models/my_llama", "docs/post_training.md": None}
WALK_STEPS = re.compile(r"\bstep-(100|120|40)\b")  # the step folders the walk-throughs' full runs write

# (doc, the command as the doc gives it, the figures it gives beside it): checked against what the command prints
FIGURES = [
    ("train_configs/llama_1b.toml", "python -m titanlite.dryrun --config llama_1b.toml --ngpu 8", ["40,696", "33.5"]),
    ("train_configs/llama_3b.toml", "python -m titanlite.dryrun --config llama_3b.toml --ngpu 8", ["16,613", "32.9"]),
    ("train_configs/llama_8b.toml", "python -m titanlite.dryrun --config llama_8b.toml --ngpu 8", ["7,190", "20.8"]),
    ("train_configs/qwen3_0.6b.toml", "python -m titanlite.dryrun --config qwen3_0.6b.toml --ngpu 8",
     ["58,943", "47,415", "27.8"]),
    ("train_configs/qwen3_8b.toml", "python -m titanlite.dryrun --config qwen3_8b.toml --ngpu 8",
     ["9,923", "7,918", "51.5"]),
]
# the same for the planner's searches and the 405B dry run (`./run_train.sh --print-plan` runs titanlite.plan)
SLOW_FIGURES = [
    ("train_configs/llama_405b.toml", "python -m titanlite.dryrun --config llama_405b.toml --ngpu 512",
     ["127", "61.0"]),
    ("train_configs/llama_405b.toml", "python -m titanlite.plan --config llama_405b.toml --ngpu 512",
     ["153.8", "24.5"]),
    ("train_configs/llama_1b.toml", "NGPU=8 ./run_train.sh --config llama_1b.toml --print-plan", ["37,607.7", "24.5"]),
    ("train_configs/llama_3b.toml", "NGPU=8 ./run_train.sh --config llama_3b.toml --print-plan", ["15,347.6", "24.6"]),
    ("train_configs/llama_8b.toml", "NGPU=8 ./run_train.sh --config llama_8b.toml --print-plan",
     ["8,936.5", "59.3", "8,363.1", "43.3"]),
    ("train_configs/qwen3_0.6b.toml", "NGPU=8 ./run_train.sh --config qwen3_0.6b.toml --print-plan",
     ["56,023.7", "24.3"]),
    ("train_configs/qwen3_8b.toml", "NGPU=8 ./run_train.sh --config qwen3_8b.toml --print-plan",
     ["9,922.7", "51.5", "9,128.8"]),
]


def _argv(cmd: Command) -> tuple[dict[str, str], list[str]]:
    words = shlex.split(cmd.text)
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def _with_config(args: list[str]) -> list[str]:
    has = any(a.split("=")[0] in ("--config", "--job.config_file") for a in args)
    return args if has or "--healthcheck" in args else ["--config", "debug_model.toml", *args]


def _in_walk(cmd: Command) -> bool:
    if cmd.source not in WALKS or cmd.synopsis or cmd.why is not None:
        return False
    anchor = WALKS[cmd.source]  # a whole doc: its inline commands too, in their place
    return anchor is None or cmd.block is not None and any(c.block == cmd.block and c.text == anchor
                                                             for c in commands(cmd.source))


def _ngpu(args: list[str]) -> int:
    return int(args[args.index("--ngpu") + 1]) if "--ngpu" in args else 1


def how(cmd: Command) -> tuple[str, list[str], int] | None:
    """(what runs, its arguments, the world size), or None: this test does not know how to run it."""
    env, words = _argv(cmd)
    world = int(env.get("NGPU", "1")) * int(env.get("NNODES", "1"))
    if _in_walk(cmd):
        return "walk", words, world
    if words[:1] == ["./run_train.sh"]:
        args = _with_config(words[1:])
        if {"--print-config", "--help"} & set(args):
            return "train", args, world
        if "--healthcheck" in args:
            return None
        return "preflight", [a for a in args if a != "--print-plan"], world  # the planner's: its preflight
    if words[:2] == ["python", "-c"]:
        return "shell", [cmd.text], world
    if words[:3] == ["python", "-m", "titanlite.train"]:
        return "train", words[3:], world
    if words[:3] in (["python", "-m", "titanlite.dryrun"], ["python", "-m", "titanlite.plan"],
                     ["python", "-m", "titanlite.tools.estimate"]):
        args = words[3:]
        config = args[args.index("--config") + 1] if "--config" in args else ""
        tool = ("--ngpu", "--gpu")  # the tool's own flags; the rest is the job's
        rest = [a for i, a in enumerate(args) if a not in tool and args[i - 1] not in tool]
        if words[2] == "titanlite.dryrun" and config in CHEAP:
            return "dryrun", args, _ngpu(args)
        return "preflight", rest, _ngpu(args)
    return None


def test_every_command_runs_or_says_why():
    """Each command is a synopsis, marked with why it cannot run here, or one this test runs."""
    found = commands()
    unknown = [c for c in found if c.why is None and not c.synopsis and how(c) is None]
    counts = {"found": len(found), "distinct": len({c.text for c in found}),
              "marked": sum(c.why is not None for c in found),
              "synopses": sum(c.why is None and c.synopsis for c in found),
              "run": sum(c.why is None and not c.synopsis and how(c) is not None for c in found)}
    print(counts)
    assert not unknown, "commands with no way to run here and no `not run` marker in their doc:\n" + \
        "\n".join(f"{c.source}: {c.text}" for c in unknown)


def _run_in_process(kind: str, args: list[str], world: int, capfd) -> str:
    if kind == "train":
        from titanlite.train import main
        main(args)
    elif kind == "dryrun":
        from titanlite.dryrun.run import main
        main(args)
    elif kind == "shell":
        proc = subprocess.run(["bash", "-c", *args], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.returncode == 0, proc.stdout + proc.stderr
    else:
        cfg, _ = config_load.load(args)
        preflight(cfg, world)
    return capfd.readouterr().out


def test_commands_run_as_written(capfd, tmp_path, monkeypatch):
    """Every command outside a walk-through, in this process: its preflight, print or dry run."""
    monkeypatch.chdir(tmp_path)
    done, failed = set(), []
    for cmd in commands():
        plan = None if cmd.why or cmd.synopsis else how(cmd)
        if plan is None or plan[0] == "walk" or (plan[0], tuple(plan[1]), plan[2]) in done:
            continue
        done.add((plan[0], tuple(plan[1]), plan[2]))
        try:
            out = _run_in_process(*plan, capfd)
        except (Exception, SystemExit) as e:  # noqa: BLE001  (every failure is listed, not the first)
            failed.append(f"{cmd.source}: {cmd.text}: {type(e).__name__}: {e}")
            continue
        if plan[0] == "dryrun":
            assert "predicted on h100" in out, f"{cmd.text} printed no prediction:\n{out}"
    assert not failed, "\n".join(failed)


def _figures_hold(doc: str, command: str, figures: list[str], out: str) -> None:
    text = (REPO / doc).read_text()
    at = text.find(command)
    assert at >= 0, f"{doc} no longer gives `{command}`"
    near = text[max(0, at - 600):at + 900]
    for fig in figures:
        assert fig in near, f"{doc}: {fig} is not beside `{command}`"
        assert fig in out, f"`{command}` prints no {fig}:\n{out}"


@pytest.mark.parametrize("doc,command,figures", FIGURES, ids=[f[0] for f in FIGURES])
def test_predicted_figures_are_printed(doc, command, figures, capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from titanlite.dryrun.run import main
    main(shlex.split(command)[3:])
    _figures_hold(doc, command, figures, capfd.readouterr().out)


@pytest.mark.skipif(not SLOW, reason="minutes of CPU: TITANLITE_DOCS_SLOW=1 runs it")
@pytest.mark.parametrize("doc,command,figures", SLOW_FIGURES, ids=[f[0] for f in SLOW_FIGURES])
def test_slow_predicted_figures_are_printed(doc, command, figures, tmp_path):
    run = re.sub(r"NGPU=(\d+) \./run_train\.sh (.*) --print-plan", r"python -m titanlite.plan \2 --ngpu \1", command)
    proc = subprocess.run([sys.executable, *shlex.split(run)[1:]], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    _figures_hold(doc, command, figures, proc.stdout)


def _smoke(text: str) -> str:
    """The documented smoke override on a training run; the step folders then are step-2."""
    if text.startswith("./run_train.sh"):
        text = re.sub(r"--training\.steps \d+", "", text) + " --training.steps 2"
    return WALK_STEPS.sub("step-2", text)


def test_walkthroughs_run_in_their_own_order(tmp_path):
    """README's fork and docs/post_training.md, in a copy of the repository, one command after another."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO, repo, symlinks=True,
                    ignore=shutil.ignore_patterns(".git", "outputs", "__pycache__", "*.egg-info", ".pytest_cache"))
    env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONWARNINGS": "default"}
    for cmd in commands():
        if not _in_walk(cmd):
            continue
        text = _smoke(cmd.text)
        proc = subprocess.run(["bash", "-c", text], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{cmd.source}: `{text}` failed:\n{out[-3000:]}"
        if "titanlite.tools.convert" in text:  # its one line, no warning before it
            assert out.strip().count("\n") == 0 and out.startswith("titanlite: wrote"), out


def _keys() -> dict[str, set[str]]:
    return {f.name: {g.name for g in dataclasses.fields(f.type if isinstance(f.type, type) else
                                                         getattr(importlib.import_module("titanlite.config.job"),
                                                                 f.type))}
            for f in dataclasses.fields(JobConfig)}


def _runnable(mod: str) -> bool:
    """`python -m mod` runs something: a package's __main__, or a module with a __main__ block (a
    module without one exits 0 having printed nothing, as titanlite.dryrun.run once did)."""
    spec = importlib.util.find_spec(mod)
    if spec is None:
        return False
    if spec.submodule_search_locations is not None:
        return importlib.util.find_spec(f"{mod}.__main__") is not None
    return not mod.startswith("titanlite.") or '__name__ == "__main__"' in Path(spec.origin).read_text()


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_named_modules_files_keys_and_dotted_names_exist():
    """Every `python -m` module, repository path, train_configs file, config key and dotted titanlite.
    name that the docs give (the dotted names of docstrings too) exists."""
    keys, missing = _keys(), []
    texts = {str(p.relative_to(REPO)): p.read_text() for p in sources()}
    for cmd in commands():
        for mod in re.findall(r"-m ([\w.]*\w)(?![\w.<])", cmd.text):
            if importlib.util.find_spec(mod.split(".")[0]) and not _runnable(mod):
                missing.append(f"{cmd.source}: module {mod} (none, or it does nothing under -m)")
        for name in re.findall(r"--config (\S+\.toml)", cmd.text):
            if not (REPO / "train_configs" / name).is_file() and not (REPO / name).is_file() and not cmd.synopsis:
                missing.append(f"{cmd.source}: config {name}")
    for doc, text in texts.items():
        for span in re.findall(r"`([^`\n]+)`", text):
            # a key given as a flag anywhere, or a whole span `section.key [value]` that names no file,
            # module or model module (`metrics.py`, `metrics.reduce_losses`, `model.layers`, `moe.shared`)
            flags = re.findall(r"--([a-z_]+)\.([a-z_0-9]+)\b", span)
            bare = re.findall(r"^([a-z_]+)\.([a-z_0-9]+)(?:$|[ =])", span)
            bare = [(s, k) for s, k in bare if s not in ("model", "moe") and not _resolves(f"titanlite.{s}.{k}")
                    and k not in ("py", "jsonl", "json", "pt", "md", "toml", "log")]
            for section, key in flags + bare:
                if section in keys and key not in keys[section]:
                    missing.append(f"{doc}: config key {section}.{key} (in `{span}`)")
            path = re.match(r"^((?:titanlite|docs|models|tests|tools|train_configs)/[\w./-]*[\w/])(?:#.*)?$", span)
            if path and not re.search(r"my_|kimi_linear|/X\b|<", span) and not (REPO / path.group(1)).exists():
                missing.append(f"{doc}: path {path.group(1)}")
    dotted = [(doc, n) for doc, text in texts.items() for n in re.findall(r"\btitanlite(?:\.\w+)+", text)]
    for py in sorted((REPO / "titanlite").rglob("*.py")):
        dotted += [(str(py.relative_to(REPO)), n) for n in re.findall(r"\btitanlite(?:\.\w+)+", py.read_text())]
    skip = re.compile(r"\.(py|md|toml|json|jsonl|log)$|^titanlite\.models\.(my_|<|name)")
    for where, name in sorted(set(dotted)):
        if not skip.search(name) and not _resolves(name.rstrip(".")):
            missing.append(f"{where}: dotted name {name}")
    assert not missing, "named in the docs but not there:\n" + "\n".join(sorted(set(missing)))


def test_a_resume_into_another_kind_of_run_says_so():
    """docs/post_training.md's LoRA run once resumed the full fine-tuning's folder and named only a
    missing adapter weight: the refusal now says a resume into another kind of run caused it."""
    from titanlite.checkpoint.state import check_run_kind
    from titanlite.errors import ConfigError

    lora, full, path = {"transform": {"lora": {"rank": 8}, "base": ""}}, {"model": "llama3"}, Path("out/step-2")
    check_run_kind(path, lora, True)
    check_run_kind(path, full, False)
    with pytest.raises(ConfigError, match=r"^resuming out/step-2: that checkpoint is a run's that trains every "
                                          r"weight, and this run is a LoRA run; give this run its own job.dump_folder"):
        check_run_kind(path, full, True)
    with pytest.raises(ConfigError, match=r"is a LoRA run's \(it holds the adapters only\), and this run trains "
                                          r"every weight \(lora.rank 0\)"):
        check_run_kind(path, lora, False)
