"""Configs are data and checkpoints load without unpickling code: checked on the source itself."""

import ast
from pathlib import Path

from harness import REPO

from titanlite.config import load as config_load

SOURCES = sorted((REPO / "titanlite").rglob("*.py")) + sorted((REPO / "models").rglob("*.py"))


def _calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            yield node


def _name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return f"{_name(func.value)}.{func.attr}"
    return ""


def test_no_code_evaluation_or_unpickling_in_the_framework():
    assert SOURCES
    banned = {"eval", "exec", "compile", "pickle.load", "pickle.loads", "yaml.load", "marshal.loads"}
    found = [f"{p.relative_to(REPO)}:{c.lineno} {_name(c.func)}" for p in SOURCES for c in _calls(p)
             if _name(c.func) in banned]
    assert not found, found


def test_every_torch_load_is_weights_only():
    loads = [(p, c) for p in SOURCES for c in _calls(p) if _name(c.func).endswith("torch.load")]
    unsafe = [f"{p.relative_to(REPO)}:{c.lineno}" for p, c in loads
              if not any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                         for k in c.keywords)]
    assert not unsafe, f"torch.load without weights_only=True: {unsafe}"


def test_config_values_stay_strings(tmp_path):
    marker = tmp_path / "pwned"
    code = f"__import__('os').system('touch {marker}')"
    toml = tmp_path / "c.toml"
    toml.write_text(f'[job]\ndescription = "{code}"\nrun_name = "{{rank}}$(touch {marker})"\n')
    cfg, _ = config_load.load(["--config", str(toml), "--data.text_field", code])
    assert cfg.job.description == code and cfg.data.text_field == code
    assert cfg.job.run_name == f"{{rank}}$(touch {marker})"
    assert not marker.exists()
