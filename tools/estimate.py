"""Memory estimate per rank before launch: `python -m titanlite.tools.estimate --config X --ngpu N [overrides]`.

A dry run of one real training step (titanlite.dryrun.run) on fake tensors and a fake process
group, as this machine would train it (CUDA: bf16 by default; CPU: float32): the peak of the
memory the step's tensors take, by category. Nothing real is allocated. Covers every model
family and layout that train.py runs, since it runs the same setup.
"""

from __future__ import annotations

import sys


from titanlite.config import load as config_load
from titanlite.errors import ConfigError
from titanlite.dryrun.run import GIB, estimate, train_device
from titanlite.dryrun.steptrace import CATEGORIES

def _parse(argv: list[str]) -> tuple[int, list[str]]:
    ngpu, rest, i = 1, [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name == "--ngpu":
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError("--ngpu needs a value")
                i, value = i + 1, argv[i + 1]
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--ngpu: expected a positive integer, got '{value}'")
            ngpu = int(value)
        else:
            rest.append(argv[i])
        i += 1
    return ngpu, rest


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    try:
        ngpu, rest = _parse(argv)
        cfg, _ = config_load.load(rest)
        e, dims = estimate(cfg, ngpu)
    except ConfigError as err:
        sys.exit(f"titanlite: error: {err}")
    ac = cfg.activation_checkpoint
    mode = ac.mode + (f" ({ac.selective_type})" if ac.mode == "selective" else "")
    print(f"{cfg.model.name} {cfg.model.flavor} on {ngpu} rank(s), {dims}, "
          f"batch {cfg.training.local_batch_size}x{cfg.training.seq_len}/rank, AC {mode}, on {train_device(cfg)}")
    print(f"  at the peak (during {e.phase}):")
    for what in CATEGORIES:
        print(f"  {what:<18} {e.categories[what] / GIB:9.3f} GiB")
    print(f"  {'peak per rank':<18} {e.total / GIB:9.3f} GiB")


if __name__ == "__main__":
    main()
