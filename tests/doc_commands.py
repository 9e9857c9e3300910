"""The shell commands of the documentation, as a user would copy them (tests/test_docs.py runs them).

Where they come from: fenced ```bash blocks of README.md, docs/*.md and models/*/README.md (one
command a line, `\\` continuations joined, a trailing `# comment` dropped), their inline code spans
that start like a command (`./run_train.sh`, `python -m`, `NGPU=`, `pip`, ...), and the backticked
or indented commands of each train_configs/*.toml header.

What each one is:
- a synopsis: it holds a placeholder the user fills in (`[--flag]`, `<dump_folder>`, `{a,b}`, `...`,
  an upper-case word such as FILE, DATA or N, `/path/to/`, a `my_` file of the user's), or it is an
  inline name with no argument (`python -m titanlite.tools.merge`). It cannot run as written: its
  module, files and config keys are checked, not run;
- marked: the doc says why it does not run here. In markdown, `<!-- not run: WHY -->` on the line
  before a fence marks every command of that block, and `<!-- not run "TEXT": WHY -->` anywhere in
  the file marks each of its commands that contain TEXT; in a config header, a comment line
  `not run "TEXT": WHY`;
- otherwise the test runs it (test_docs.py says how), and a command it does not know how to run
  fails the test.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
START = re.compile(r"^(\./run_train\.sh|[A-Z_]+=\S* |python3? -m |python3? -c |python |pip |cp |sed |tensorboard |"
                   r"torchrun |torchft_lighthouse |sbatch |srun |export |for |done|nodes=)")
PLACEHOLDER = re.compile(r"\[|\]|<|>|\{|\.\.\.|/path/to/|\bmy_(job|sft|model)\b|"
                         r"(?<![\w.=/-])(?:[A-Z][A-Z_]*[A-Z]|X|N|G|R)(?![\w.=])")
MARK = re.compile(r"not run(?: \"([^\"]+)\")?: ([^>\n]+?)(?: -->|$)", re.M)


@dataclass(frozen=True)
class Command:
    source: str  # the file, relative to the repository
    text: str
    block: int | None  # the line of its fence (None: inline or a config header)
    why: str | None  # the doc's reason it does not run here

    @property
    def synopsis(self) -> bool:
        words = self.text.split()
        args = words[3:] if words[:2] == ["python", "-m"] else words[1:]
        name = self.block is None and not self.source.endswith(".toml") and all(a.startswith("--") for a in args) \
            and words[0] in ("python", "./run_train.sh")  # a tool named inline, no value given
        unquoted = re.sub(r"\"[^\"]*\"|'[^']*'", "", self.text)  # ".[test]", sed's script: literal
        return name or bool(PLACEHOLDER.search(unquoted))


def sources() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "models").glob("*/README.md")),
            *sorted((REPO / "train_configs").glob("*.toml"))]


def _marks(text: str) -> list[tuple[str | None, str]]:
    return [(m.group(1), m.group(2).strip()) for m in MARK.finditer(text)]


def _why(text: str, marks: list[tuple[str | None, str]], block_why: str | None) -> str | None:
    for part, why in marks:
        if part is not None and part in text:
            return why
    return block_why


def _header(path: Path) -> list[Command]:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:])
    marks, rel = _marks("\n".join(lines)), str(path.relative_to(REPO))
    found = [m.group(1) for m in re.finditer(r"`([^`]+)`", "\n".join(lines)) if START.match(m.group(1))]
    found += [line.strip() for line in lines if line.startswith("   ") and START.match(line.strip())]
    return [Command(rel, re.sub(r"\s+\(.*\)$", "", c), None, _why(c, marks, None)) for c in found]


def _markdown(path: Path) -> list[Command]:
    text = path.read_text()
    marks, rel, out = _marks(text), str(path.relative_to(REPO)), []
    lines = text.splitlines()
    fence, lang, block, start = None, "", [], 0
    for i, line in enumerate(lines):
        opening = re.match(r"^\s*```(\w*)\s*$", line)
        if fence is None and opening:
            fence, lang, block, start = i, opening.group(1), [], i
            continue
        if fence is not None:
            if re.match(r"^\s*```\s*$", line):
                if lang in ("bash", "sh", "shell"):
                    above = lines[start - 1] if start else ""
                    block_why = next((why for part, why in _marks(above) if part is None), None)
                    out += [Command(rel, c, start + 1, _why(c, marks, block_why)) for c in _joined(block)]
                fence = None
            else:
                block.append(line)
            continue
        out += [Command(rel, m.group(1), None, _why(m.group(1), marks, None))
                for m in re.finditer(r"`([^`]+)`", line) if START.match(m.group(1))]
    return out


def _joined(block: list[str]) -> list[str]:
    out, cur = [], ""
    for line in block:
        line = line.strip()
        if line.endswith("\\"):
            cur += line[:-1]
            continue
        cur = re.sub(r"\s+#\s.*$", "", cur + line).strip()
        if cur and not cur.startswith("#"):
            out.append(re.sub(r"\s+", " ", cur))
        cur = ""
    return out


@functools.cache
def commands(source: str | None = None) -> tuple[Command, ...]:
    """Every command of the docs, or of one (its path relative to the repository), in order."""
    paths = sources() if source is None else [REPO / source]
    return tuple(c for p in paths for c in (_header(p) if p.suffix == ".toml" else _markdown(p)))
