"""`python -m titanlite.eval CKPT --tasks a,b [...]`: a checkpoint scored on lm-eval tasks through
lm-eval's Python API and the registered titanlite model class (titanlite.eval.harness). Nothing
downloads: HF_DATASETS_OFFLINE and HF_HUB_OFFLINE are set unless already given, so a task whose
data is not on this machine is refused in one line instead of waiting on the network."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from titanlite.errors import ConfigError


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m titanlite.eval", description=__doc__)
    p.add_argument("path", help="a titanlite step folder, a LoRA run's checkpoint, or a transformers folder")
    p.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated")
    p.add_argument("--format", default="dcp", choices=("dcp", "hf"))
    p.add_argument("--tokenizer", default="", help="byte, byte_chat or a folder (default: the folder's own, else byte)")
    p.add_argument("--include_path", default="", help="a folder of task YAML files (local tasks)")
    p.add_argument("--limit", type=int, default=0, help="examples per task; 0: all")
    p.add_argument("--batch_size", type=int, default=8,
                   help="requests per forward (those of one context share its forward)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="", help="write lm-eval's results JSON here (default: print it)")
    return p.parse_args(argv)


def offline() -> None:
    """HF_DATASETS_OFFLINE and HF_HUB_OFFLINE on, unless the environment says otherwise. datasets and
    huggingface_hub read them once, at import: where a caller imported them before this (a notebook,
    a test session), the values they read are set too, or a task with no local data would retry the
    network for half a minute before failing."""
    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        os.environ.setdefault(key, "1")
    if os.environ["HF_HUB_OFFLINE"] == "1" and "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].constants.HF_HUB_OFFLINE = True
    if os.environ["HF_DATASETS_OFFLINE"] == "1" and "datasets" in sys.modules:
        import datasets.config
        datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True


def run(args: argparse.Namespace, manager: Any = None) -> dict:
    """lm-eval's results dict for the checkpoint; bad input raises ConfigError. `manager`: an
    lm-eval TaskManager to reuse (indexing lm-eval's own tasks takes seconds), else one is made."""
    offline()
    if args.limit < 0 or args.batch_size < 1:
        raise ConfigError("--limit must be >= 0 and --batch_size >= 1")
    if args.include_path and not Path(args.include_path).is_dir():
        raise ConfigError(f"--include_path {args.include_path} is not a folder")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from titanlite.eval.harness import TitanliteLM

    manager = manager or TaskManager(include_path=args.include_path or None)
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if not tasks or unknown:
        raise ConfigError(f"--tasks: {', '.join(unknown) or 'none given'}: not an lm-eval task here; "
                          "give a task lm-eval lists, or a folder of task YAML files with --include_path")
    model = TitanliteLM(args.path, args.format, args.tokenizer, batch_size=args.batch_size, device=args.device)
    try:
        return lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=manager, limit=args.limit or None)
    except Exception as e:
        if no_local_data(e):
            raise ConfigError(f"--tasks: a task's data is not on this machine ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200]}); point its dataset_path/data_files at local "
                              "files, or put the data set in the Hugging Face cache") from None
        raise


def no_local_data(e: Exception) -> bool:
    """Whether loading an lm-eval task failed for want of its data set offline (datasets' offline
    refusals have no common class)."""
    return "offline" in str(e).lower() or "connect" in str(e).lower() or type(e).__name__ in (
        "DatasetNotFoundError", "FileNotFoundError", "OfflineModeIsEnabled")


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        results = run(args)
    except ConfigError as e:
        print(f"titanlite: error: {e}", file=sys.stderr)
        sys.exit(2)
    results.pop("samples", None)
    text = json.dumps(results, indent=2, default=str)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    for task, metrics in results["results"].items():
        print(f"titanlite: {task}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()
                                                  if isinstance(v, float)), file=sys.stderr)


if __name__ == "__main__":
    main()
