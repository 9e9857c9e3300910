"""`pip install .` ships what a user needs outside a checkout, under the titanlite name only."""

import subprocess
import sys
import zipfile

from harness import REPO


def test_the_wheel_holds_models_configs_and_tools_under_titanlite(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("titanlite-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ["titanlite/train.py", "titanlite/parallel/__init__.py", "titanlite/parallel/apply.py",
                   "titanlite/models/llama3/model.py", "titanlite/models/qwen3/hf.py",
                   "titanlite/train_configs/debug_model.toml", "titanlite/tools/convert.py"]:
        assert needed in names, needed
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"titanlite"}, tops  # no bare `models` package to collide with a user's
