"""DeepSeek-V3 under every parallel dimension reproduces its single-process run on the same
global batch (loss, gradient norm, MTP loss and router biases over 10 steps), with two
four-rank launches: FSDP x TP (sequence and loss parallel, MLA's latent projections whole on
each rank) with the experts split over the tp pair under per-op AC, and PP x CP (the MTP depth on the last
stage) with the experts split over the cp pair. The second saves checkpoints, from which a
resumed run continues bit for bit on its own layout, and to parity on others that change the
pp and ep degrees: FSDP 2 (experts split over dp_shard) and one compiled process (MLA, the
router, the shared and the routed experts compiled). Per-parameter gradients under TP, HSDP and an
interleaved pipeline schedule (MTP on the last stage): tests/grad_parity.py."""

import shutil

import pytest

from harness import TINY, Run, assert_grad_parity, assert_parity, reference, train

from titanlite.checkpoint.folder import load_tensors

DSV3 = [*TINY, "--model.name", "deepseek_v3", "--training.global_batch_size", "8", "--moe.bias_update_rate", "0.001",
        "--lr_scheduler.decay_ratio", "0"]
REFERENCE = [*DSV3, "--training.local_batch_size", "8"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
CHECKPOINT = ["--checkpoint.enable", "--checkpoint.interval", "5"]
# per-op activation checkpointing on top: recomputation must neither count a layer's routed
# tokens nor its extra loss terms twice
FSDP_TP = ["--training.local_batch_size", "4", "--parallelism.data_parallel_shard_degree", "2",
           "--parallelism.tensor_parallel_degree", "2", *EP2,
           "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_type", "op"]
# four pipeline micro-batches of two rows; the reference runs the eight rows as one micro-batch
PP_CP = ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2",
         "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
         "--parallelism.pipeline_parallel_microbatch_size", "2", *EP2, *CHECKPOINT]
# layouts the PP_CP run's step-5 checkpoint resumes on, with other pp and ep degrees
# (nproc, args): no pipeline, FSDP 2 with the experts split over dp_shard instead of cp;
# one process, every expert whole, compiled
RESHARDED = {"dp_ep_over_dp": (2, ["--training.local_batch_size", "4", *EP2]),
             "one_process_compiled": (1, ["--training.local_batch_size", "8", "--compile.enable", "true"])}
LOGGED = ("grad_norm", "mtp_loss", "moe_router_bias_norm")


def _close(ref: list[float], got: list[float], first_rtol: float, rtol: float) -> None:
    """assert_parity's rule for the steps a resumed run has (fewer than its ten)."""
    assert len(ref) == len(got) > 0, (ref, got)
    rel = [abs(a - b) / abs(a) for a, b in zip(ref, got)]
    assert rel[0] <= first_rtol and max(rel) <= rtol, (rel, ref, got)


def _matches(ref, run, start: int = 0) -> None:
    """run's steps match ref's from step start + 1 on (a resumed run's from its first)."""
    rows = ref.metrics[start:]
    check = assert_parity if start == 0 else _close
    check([r["loss"] for r in rows], run.losses, 1e-6, 1e-4)
    for key in LOGGED:
        check([r[key] for r in rows], [r[key] for r in run.metrics], 1e-5, 1e-4)
    assert [r["moe_load_max_over_mean_avg"] for r in rows] == [r["moe_load_max_over_mean_avg"] for r in run.metrics]
    assert run.metrics[-1]["moe_router_bias_norm"] > 0 and run.metrics[-1]["mtp_loss"] > 0


@pytest.fixture(scope="module")
def pp_cp(tmp_path_factory) -> Run:
    """The PP x CP x EP run (checkpoints at steps 5 and 10), matched to one process."""
    run = train(4, [*DSV3, *PP_CP], dump=tmp_path_factory.mktemp("pp_cp"))
    _matches(reference(REFERENCE), run)
    return run


def test_fsdp_tp_ep_ac_matches_single_process():
    ref = reference(REFERENCE)
    _matches(ref, train(4, [*DSV3, *FSDP_TP]))


def test_pp_cp_ep_matches_single_process_and_resumes_bitwise(pp_cp, tmp_path):
    run = pp_cp
    shutil.copytree(run.dump / "checkpoint" / "step-5", tmp_path / "checkpoint" / "step-5")
    again = train(4, [*DSV3, *PP_CP], dump=tmp_path)
    assert "resumed from" in again.output
    assert again.losses == run.losses[5:]
    assert [r["mtp_loss"] for r in again.metrics] == [r["mtp_loss"] for r in run.metrics[5:]]
    a, b = (load_tensors(d / "checkpoint" / "step-10") for d in (run.dump, tmp_path))
    assert a.keys() == b.keys() and a["mtp.0.block.moe.router.expert_bias"].abs().sum() > 0
    assert all(a[k].equal(b[k]) for k in a), [k for k in a if not a[k].equal(b[k])][:5]


@pytest.mark.parametrize("layout", RESHARDED)
def test_pp_cp_checkpoint_resumes_on_other_pp_and_ep_degrees(layout, pp_cp, tmp_path):
    """What the new layout loaded, saved again, is the checkpoint tensor for tensor (the MTP
    depth, the router biases, the optimizer state), and it trains on from the saved data
    position as the single process does."""
    nproc, args = RESHARDED[layout]
    shutil.copytree(pp_cp.dump / "checkpoint" / "step-5", tmp_path / "checkpoint" / "step-5")
    run = train(nproc, [*DSV3, *args, *CHECKPOINT], dump=tmp_path, env={"TITANLITE_TEST_HOOK": "resave"},
                module="tests.ckpt_hooks")
    # each rank's generators aside: they are keyed by the layout, and another layout's differ
    saved, loaded = ({k: v for k, v in load_tensors(d / "step-5", "").items() if not k.startswith("rng.")}
                     for d in (pp_cp.dump / "checkpoint", tmp_path / "checkpoint-resaved"))
    assert saved.keys() == loaded.keys(), sorted(set(saved) ^ set(loaded))
    assert saved["model.mtp.0.block.moe.router.expert_bias"].abs().sum() > 0
    assert any(k.startswith("optimizer.state.mtp.0.") for k in saved)
    assert all(saved[k].equal(loaded[k]) for k in saved), [k for k in saved if not saved[k].equal(loaded[k])][:5]
    assert [r["step"] for r in run.metrics] == list(range(6, 11))
    _matches(reference(REFERENCE), run, start=5)


def test_every_gradient_matches_under_tp_hsdp_and_interleaved_pp():
    # the shared RoPE key's gradient left unsummed over the tp ranks' heads passed the loss
    # parity above (7e-5 after 10 steps); per parameter it is off by 2%. HSDP: experts split
    # over dp_shard, replicated over two replicas. Interleaved1F1B: four stages need four blocks
    # (the debug flavor has three), the MTP depth on the last, on the other rank than the
    # embedding it shares. Muon on the first and last: the shared experts and the MTP depth's
    # block are block matrices, orthogonalised whole once each.
    layouts = "2 2 ep=2 muon + 2 2 nosp ep=2 + 2 1 ep=2 rep=2 + pp 2 2 1 Interleaved1F1B ep=2 layers=4 muon"
    assert_grad_parity("deepseek_v3", 4, layouts.split())
