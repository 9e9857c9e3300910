"""Replica groups through torchft (fault_tolerance.enable): two groups of 2 gloo ranks (FSDP 2
inside each), each its own launch with its own rendezvous port, and a lighthouse this test starts
on 127.0.0.1. Each step's global batch is split over the groups in its quorum and the target count
summed over it, so every step matches one process on the same global batch, whether both groups
train it or one."""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

import pytest
import torch

from harness import TINY, Run, assert_parity, fork_ranks, reference

torchft = pytest.importorskip("torchft")

LIMIT_S = 240
ARGS = [*TINY, "--training.global_batch_size", "8", "--training.local_batch_size", "2",
        "--comm.train_timeout_s", "120"]


@contextlib.contextmanager
def lighthouse(min_replicas: int):
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=1000,
                              heartbeat_timeout_ms=2000)
    try:
        yield server.address()
    finally:
        server.shutdown()


def group(replica_id: int, address: str, dump: Path, extra: list[str] = (), env: dict | None = None,
          nproc: int = 2):
    """One replica group of 2 ranks, as its own torchrun would start it (a port of its own)."""
    logs = [dump.parent / f"{dump.name}-rank{r}.log" for r in range(nproc)]
    args = [*ARGS, "--job.dump_folder", str(dump), "--fault_tolerance.enable", "true",
            "--fault_tolerance.replica_id", str(replica_id), "--fault_tolerance.group_size", "2",
            "--fault_tolerance.lighthouse", address, "--fault_tolerance.timeout_s", "20", *extra]
    return fork_ranks(nproc, ["-m", "titanlite.train", *args], logs, env), logs


def wait_all(procs, logs, timeout: float = LIMIT_S) -> None:
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "".join(Path(f).read_text()[-3000:] for f in logs)
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_two_groups_with_fsdp_inside_match_one_process(tmp_path):
    """Both groups train every step (min_replica_size 2): each step's loss and gradient norm, in
    both groups, and every parameter after 10 steps (so every gradient), match one process on
    the same global batches; group 0 alone writes checkpoints."""
    from titanlite.checkpoint.folder import load_tensors

    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "5"]
    ref = reference([*ARGS, *ckpt])
    with lighthouse(2) as address:
        runs = [group(r, address, tmp_path / f"g{r}", ["--fault_tolerance.min_replica_size", "2", *ckpt])
                for r in range(2)]
        procs = [p for ps, _ in runs for p in ps]
        wait_all(procs, [f for _, fs in runs for f in fs])
    logs = "".join(f.read_text() for _, fs in runs for f in fs)
    for r in range(2):
        run = Run(0, "", tmp_path / f"g{r}")
        assert_parity(ref.losses, run.losses, first_rtol=1e-4)
        assert_parity([m["grad_norm"] for m in ref.metrics], [m["grad_norm"] for m in run.metrics], first_rtol=1e-4)
    assert all(p.poll() in (0, -6) for p in procs), logs[-4000:]
    want, got = load_tensors(ref.dump / "checkpoint" / "step-10"), load_tensors(tmp_path / "g0" / "checkpoint" / "step-10")
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    # one group writes the checkpoints: the first of the quorum
    assert sorted(p.name for p in (tmp_path / "g0" / "checkpoint").iterdir()) == ["step-10", "step-5"]
    assert not (tmp_path / "g1" / "checkpoint").exists() or not any((tmp_path / "g1" / "checkpoint").iterdir())
    # a whole-job restart: group 0 resumes from its step-5, group 1 (no checkpoint) heals from it
    shutil.rmtree(tmp_path / "g0" / "checkpoint" / "step-10")
    with lighthouse(2) as address:
        runs = [group(r, address, tmp_path / f"g{r}", ["--fault_tolerance.min_replica_size", "2", *ckpt])
                for r in range(2)]
        wait_all([p for ps, _ in runs for p in ps], [f for _, fs in runs for f in fs])
    again = "".join(f.read_text() for _, fs in runs for f in fs)
    assert "healed from a live peer at step 5" in again, again[-3000:]
    for r in range(2):
        resumed = {m["step"]: m["loss"] for m in Run(0, "", tmp_path / f"g{r}").metrics}  # later rows win
        assert_parity(ref.losses, [resumed[s] for s in range(1, 11)], first_rtol=1e-4)


def test_replica_group_keys_are_refused_in_one_line(monkeypatch):
    import importlib.util

    from titanlite.config import load as config_load
    from titanlite.errors import ConfigError

    on = ["--fault_tolerance.enable", "true", "--fault_tolerance.lighthouse", "http://127.0.0.1:1"]
    cases = [([*on, "--fault_tolerance.replica_id", "2", "--fault_tolerance.group_size", "2"], "need 0 <= replica_id"),
             ([*on, "--parallelism.pipeline_parallel_degree", "2"], "pipeline_parallel_degree 2"),
             ([*on, "--training.on_spike", "skip"], "do not share the spike window"),
             ([*on, "--fault_tolerance.timeout_s", "100"], r"below comm.train_timeout_s \(100\), got 100"),
             ([*on, "--data.streaming", "true", "--data.path", "tests"], "data.streaming has no sample order"),
             ([*on, "--fault_tolerance.rerun_on_nonfinite", "true", "--fault_tolerance.max_restarts", "1"],
              "a replica group heals from its peers instead"),
             (["--fault_tolerance.enable", "true"], "needs the lighthouse's address")]
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    for args, says in cases:
        with pytest.raises(ConfigError, match=says):
            config_load.load(args)
    # a restarted group heals from a peer: no checkpoint of its own needed
    cfg, _ = config_load.load([*on, "--fault_tolerance.max_restarts", "1", "--fault_tolerance.group_size", "2",
                               "--training.local_batch_size", "4"])
    from titanlite.preflight import preflight

    # the global batch (4, the default: local x dp) cannot split over a quorum of 2 groups
    with pytest.raises(ConfigError, match="training.global_batch_size 4 does not split over a quorum of 2 replica "
                                          "groups x 1 data-parallel ranks x local_batch_size 4"):
        preflight(cfg, world_size=1)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs torchft, which is not installed: pip install 'titanlite\[ft\]'"):
        config_load.load(on)


def _noise(console: str) -> list[str]:
    """A console's lines that are neither titanlite's nor a step's."""
    return [line for line in console.splitlines() if line.strip() and not line.startswith(("titanlite:", "step "))]


@pytest.mark.parametrize("restarts", [1, 0])
def test_a_killed_group_heals_or_stays_down_while_the_other_logs_every_step(tmp_path, restarts):
    """Group 1 (./run_train.sh, its own torchrun) loses rank 1 at step 5; group 0 never stops.
    With restarts 1, group 1 is restarted by its own fault_tolerance.max_restarts and heals from
    group 0 with equal parameters, Muon's momentum and the skipped-step count (step 3's NaN,
    skipped by both groups: the quorum's gradient is NaN), group 0 sleeping in each step from
    then on so that it is still running; with 0, it stays down and group 0 finishes alone.
    Either way group 0 logs steps 1-32, each loss that of one process on the same global batches,
    whoever trained them. Every console (Python warnings on, as a user has them) holds titanlite's
    lines alone: torchft's traceback of the broken all-reduce, torch's warnings and torchft's
    HTTP access log go to the groups' <dump_folder>/logs/."""
    from test_launcher import output, run_sh

    # muon_lr as run_train.sh's default config (debug_model.toml) has it, for group 0 and the reference too
    extra = ["--training.steps", "32", "--optimizer.name", "Muon", "--optimizer.muon_lr", "1.6e-2",
             "--training.on_nonfinite", "skip"]
    args, nan = [*ARGS, *extra], "nan@3"
    ref = reference(args, env={"TITANLITE_FAULTS": nan})
    g0, logs = [], []
    with lighthouse(1) as address:
        try:
            # group 1 commits only with group 0 (min_replica_size 2), which starts once group 1 is
            # up: both train from step 1
            with run_sh([*args, "--skip-preflight", "--fault_tolerance.enable", "true",
                         "--fault_tolerance.replica_id", "1", "--fault_tolerance.group_size", "2",
                         "--fault_tolerance.lighthouse", address, "--fault_tolerance.timeout_s", "20",
                         "--fault_tolerance.min_replica_size", "2", "--fault_tolerance.max_restarts", str(restarts)],
                        tmp_path / "g1", env={"TITANLITE_FAULTS": f"kill@5:1,{nan}", "PYTHONWARNINGS": "default"}
                        ) as (proc, out):
                deadline = time.monotonic() + LIMIT_S
                while not any(line.startswith("titanlite: llama3") for line in output(out)):
                    assert proc.poll() is None and time.monotonic() < deadline, output(out)[-30:]
                    time.sleep(0.1)
                g0, logs = group(0, address, tmp_path / "g0", extra, env={
                    "TITANLITE_FAULTS": ("slow@5," if restarts else "") + nan, "PYTHONWARNINGS": "default"})
                code = proc.wait(timeout=LIMIT_S)
                lines = output(out)
        finally:
            wait_all(g0, logs)
    g0_out = "".join(f.read_text() for f in logs)
    run = Run(0, "", tmp_path / "g0")
    assert [m["step"] for m in run.metrics] == list(range(1, 33)), g0_out[-3000:]
    assert_parity(ref.losses, run.losses, first_rtol=1e-4)
    assert [m["skipped_steps"] for m in run.metrics][1:4] == [0, 1, 1], run.metrics[:4]
    assert all(p.poll() in (0, -6) for p in g0), g0_out[-3000:]
    assert "titanlite: step 5: 1 replica group(s) in the quorum (was 2)" in g0_out, g0_out[-3000:]
    said = "\n".join(lines)
    assert not _noise(g0_out) and not _noise(said), (_noise(g0_out), _noise(said))
    assert "SIGTERM" not in said, said  # torchrun's, to group 1's surviving rank: not the user's
    kept = {g: "".join(f.read_text() for f in (tmp_path / g / "logs").glob("rank-*.log")) for g in ("g0", "g1")}
    if not restarts:
        assert code == 1 and lines[-1].startswith("titanlite: error: rank 1 was killed by SIGKILL"), said
        return
    assert code == 0, said
    assert '"GET /checkpoint/' in kept["g0"], kept["g0"][-3000:]  # the serving group's access log, kept
    (restarted,) = [line for line in lines if "restart 1 of at most 1" in line]
    assert restarted == ("titanlite: rank 1 was killed by SIGKILL at step 5; restart 1 of at most 1, resuming "
                         "from step 0 (no checkpoint was complete), then healing from a live replica group"), said
    healed = [line for line in lines if "healed from a live peer" in line]
    assert len(healed) == 1 and "its parameters equal the quorum's" in healed[0], said
    # from the heal on, group 1 logs group 0's losses (the quorum's), bit for bit, and its count
    step = int(healed[0].split(" at step ")[1].split(" ")[0])
    mine = Run(0, "", tmp_path / "g1").line
    assert all(mine[s]["loss"] == run.losses[s - 1] for s in range(step + 1, 31)), (step, mine)
    assert {mine[s]["skipped_steps"] for s in range(step + 1, 33)} == {1}, mine


class _Sampler:
    """The loader's part of a heal: the skipped sample ranges."""

    def __init__(self, skip):
        self.skip = skip

    def set_skip(self, skip):
        self.skip = tuple(skip)


def test_a_heal_carries_muon_and_adamw_state_and_counts_bit_for_bit():
    """What torchft's transport carries between the same ranks of two groups (heal_state ->
    pickle -> load_heal_state), in one process, with Muon (its momentum for the blocks' matrices,
    AdamW's moments for the rest): a fresh model, optimizer and counts take a trained one's, and
    one more step on the same batch gives both bit-identical parameters and state."""
    import dataclasses
    import io
    from types import SimpleNamespace

    import torch.nn.functional as F

    from titanlite.config.job import LRScheduler, Optimizer
    from titanlite.layers import init
    from titanlite.layers.attention import AttnContext
    from titanlite.model_spec import get_model_spec, model_args
    from titanlite.optim import build_optimizers
    from titanlite.runtime.replicas import heal_state, load_heal_state
    from titanlite.runtime.verdict import Counts

    spec = get_model_spec("llama3")
    args = dataclasses.replace(model_args(spec, "debugmodel", 0, 32), dim=128, n_layers=1)  # one block: Muon's
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))

    def build(seed):
        with torch.device("meta"):
            model = spec.build(args)
        init.materialize(model, torch.device("cpu"), seed=seed)
        return model, build_optimizers([model], Optimizer(name="Muon", lr=1e-3), LRScheduler(warmup_steps=2), 10)

    def step(model, opts):
        logits = model(tokens[:, :-1], AttnContext(seq_len=32, device=torch.device("cpu")))
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opts.step()
        opts.step_schedule()
        opts.zero_grad()

    (live, live_opts), (healing, healing_opts) = build(0), build(1)
    step(live, live_opts)
    counts, fresh = Counts(skipped=2, spikes=1, streak=[7]), Counts()
    sent = io.BytesIO()
    torch.save(heal_state([live], live_opts, SimpleNamespace(batch_sampler=_Sampler(((8, 16),))), 1,
                          {"guard": counts}), sent)
    sent.seek(0)
    healing_loader = SimpleNamespace(batch_sampler=_Sampler(()))
    assert load_heal_state(torch.load(sent, weights_only=False), [healing], healing_opts, healing_loader,
                           {"guard": fresh}) == 1
    assert fresh == counts and healing_loader.batch_sampler.skip == ((8, 16),)
    step(live, live_opts)
    step(healing, healing_opts)
    for (n, a), b in zip(live.named_parameters(), healing.parameters()):
        assert torch.equal(a, b), n
    states = [[st for opt in o.optimizers for st in opt.state.values()] for o in (live_opts, healing_opts)]
    kinds = {k for st in states[0] for k in st}
    assert kinds == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}, kinds
    for a, b in zip(*states):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert live_opts.lr == healing_opts.lr


def test_more_groups_than_group_size_are_refused(tmp_path):
    """Two groups that both say replica_id 0 of group_size 1 (one forgot to change it): the
    split was checked for one group only, so neither trains a step."""
    with lighthouse(2) as address:
        runs = [group(0, address, tmp_path / f"g{r}", ["--fault_tolerance.group_size", "1"], nproc=1)
                for r in range(2)]
        wait_all([p for ps, _ in runs for p in ps], [f for _, fs in runs for f in fs])
    for r, (ps, fs) in enumerate(runs):
        out = fs[0].read_text()
        assert ps[0].poll() == 1 and ("titanlite: error: step 1: 2 replica groups joined the quorum, but "
                                      "fault_tolerance.group_size is 1") in out, out[-3000:]
        assert not Run(0, "", tmp_path / f"g{r}").metrics


def test_the_per_step_cost_of_replica_groups_in_docs_scaling_and_the_dry_run():
    """docs/scaling.md's figure (llama_70b's fp32 gradient shard on 64 GPUs, 16 groups of H100s),
    and the dry run of one group: its share of the global batch, plus the quorum and the
    cross-group all-reduce of its gradients."""
    from titanlite.config import load as config
    from titanlite.dryrun.hardware import get_gpu
    from titanlite.dryrun.report import report
    from titanlite.dryrun.run import dry_run
    from titanlite.dryrun.timing import replica_step_seconds

    h100 = get_gpu("h100")
    assert replica_step_seconds(1e9, 1, h100) == 0.0
    assert round(replica_step_seconds(70.6e9 / 64 * 4, 16, h100), 3) == 0.234

    shape = ["--config", "debug_model.toml", "--training.seq_len", "64", "--training.local_batch_size", "2",
             "--training.global_batch_size", "8"]
    ft = ["--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2",
          "--fault_tolerance.lighthouse", "http://127.0.0.1:29510"]
    alone, grouped = (report(dry_run(config.load(argv)[0], 2), h100) for argv in (shape, [*shape, *ft]))
    assert alone["predicted"]["replica_groups_s"] == 0.0 and grouped["config"]["global_batch_size"] == 4
    # half the global batch: half the micro-batches traced (2 -> 1 per rank), half the FLOPs
    assert grouped["roles"][0]["flops_per_step"] == pytest.approx(alone["roles"][0]["flops_per_step"] / 2, rel=1e-6)
    grads = grouped["roles"][0]["memory_gib"]["gradients"]
    assert grads > 0
    across = grouped["predicted"]["replica_groups_s"]
    assert across > 0.05  # the quorum's round trip at least
    assert grouped["predicted"]["step_s"] == pytest.approx(grouped["roles"][0]["step_s"] + across)


def test_the_recovery_times_are_measured_from_the_docs_example():
    """tools/bench_recovery, whose figures docs/reliability.md gives, runs that page's example: the
    lighthouse's flags and every flag of the groups' run_train.sh are the example's."""
    import re

    from titanlite.tools.bench_recovery import LIGHTHOUSE, group_command

    doc = (Path(__file__).resolve().parent.parent / "docs" / "reliability.md").read_text()
    assert " ".join(LIGHTHOUSE) + " &" in doc
    example = re.search(r"\*\*Groups on one machine\*\*.*?```bash(.*?)```", doc, re.S).group(1)
    example = " ".join(example.replace("\\\n", " ").split())
    cmd = " ".join(group_command(1, Path("out"))[1:])
    cmd = cmd.replace("replica_id 1", "replica_id $g").replace("out/g1", "out/g$g").replace(" --metrics.log_freq 1", "")
    assert "./run_train.sh " + cmd + " &" in example, (cmd, example)
