"""Process groups one rank holds once the meshes are built, for a few layouts, in one process.

    python -m titanlite.tools.bench_groups
    PYTHONPATH=OTHER_CHECKOUT python tools/bench_groups.py     # another titanlite's meshes

Each layout's meshes are built on torch's "fake" backend (the dry run's: no peers, no
communication) as the world's last rank, whose coordinates are all non-zero. Counts the groups
the rank holds, the default one included, and the distinct sets of ranks among them; with
each set made once, the two agree. Prints a Markdown table.
"""

from __future__ import annotations

import torch.distributed as dist

import titanlite.dryrun.run  # noqa: F401  registers torch's "fake" backend
from titanlite.parallel.mesh import ParallelDims

LAYOUTS = [("fsdp 8", ParallelDims(1, 8, 1, 1), 8), ("fsdp 4 x tp 2", ParallelDims(1, 4, 1, 2), 8),
           ("fsdp 4 x tp 2, ep 4", ParallelDims(1, 4, 1, 2, ep=4), 8),
           ("hsdp 2x2 x cp 2 x tp 2 x pp 2", ParallelDims(2, 2, 2, 2, pp=2), 32)]


def main() -> None:
    print("| layout | world | process groups per rank | distinct rank sets |\n| --- | --- | --- | --- |")
    for name, dims, world in LAYOUTS:
        dist.init_process_group("fake", store=dist.HashStore(), rank=world - 1, world_size=world)
        try:
            dims.build_meshes("cpu")
            # private: torch lists the groups a process holds nowhere public
            held = [tuple(dist.get_process_group_ranks(g)) for g in dist.distributed_c10d._world.pg_map]
        finally:
            dist.destroy_process_group()
        print(f"| {name} | {world} | {len(held)} | {len(set(held))} |")


if __name__ == "__main__":
    main()
