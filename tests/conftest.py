import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture
def fork(tmp_path, monkeypatch):
    """make(name, spec_name, [(file, old, new), ...]): models/llama3 copied as family `name` with
    `SPEC.name = spec_name` and those edits, registered in-process from tmp_path as a copied folder
    is from models/ (titanlite.models' search path); the copies are forgotten afterwards."""
    import titanlite.models

    families = tmp_path / "families"
    monkeypatch.setattr(titanlite.models, "__path__", [*titanlite.models.__path__, str(families)])
    made = []

    def make(name: str, spec_name: str, edits: tuple[tuple[str, str, str], ...] = ()) -> None:
        folder = families / name
        shutil.copytree(Path(titanlite.models.__path__[0]) / "llama3", folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
        for file, old, new in (("__init__.py", 'name="llama3"', f'name="{spec_name}"'), *edits):
            text = (folder / file).read_text()
            assert text.count(old) == 1, f"{old!r} not found exactly once in {folder / file}"
            (folder / file).write_text(text.replace(old, new))
        made.append(name)

    yield make
    for name in [m for m in sys.modules if any(m.startswith(f"titanlite.models.{n}") for n in made)]:
        del sys.modules[name]


@pytest.fixture(autouse=True)
def stderr_restored():
    """A test that runs the trainer in process leaves stderr routed to its run's log
    (titanlite.runtime.console.quiet): give the next test the console back."""
    yield
    from titanlite.runtime import console

    console.restore()
