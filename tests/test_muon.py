"""Muon: the single-device step against torch.optim.Muon, the parameter split, skipped steps, and
every layout against one process (titanlite.optim.muon).

Where the definitions differ from torch.optim.Muon (checked below with the differences removed):
- Newton-Schulz runs in the parameters' compute dtype (float32 on CPU, bfloat16 with mixed
  precision); torch.optim.Muon always runs it in bfloat16. The comparison uses bfloat16.
- The update is always scaled by Moonlight's 0.2 x sqrt(max(A, B)) (torch: adjust_lr_fn=
  "match_rms_adamw"; its default, "original", scales by sqrt(max(1, A / B))).
- 3-D expert weights [n_experts, A, B] are taken as n_experts matrices (torch: 2-D only), and
  a device flag (found_inf) skips a step without a host sync.
"""

import shutil

import torch
import torch.nn as nn
from harness import TINY, assert_grad_parity, assert_parity, train
from test_checkpoint import assert_same_tensors, hooked

from titanlite.model_spec import get_model_spec, model_args
from titanlite.optim.muon import Muon, split_params


def _pair(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ws = [torch.randn(s, generator=gen) for s in shapes]
    return [nn.Parameter(w.clone()) for w in ws], [nn.Parameter(w.clone()) for w in ws]


def test_muon_matches_torch_muon_bit_for_bit():
    ours, theirs = _pair([(16, 8), (8, 24), (16, 8), (32, 32)])
    a = Muon(ours, lr=0.01, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5, ns_dtype=torch.bfloat16)
    b = torch.optim.Muon(theirs, lr=0.01, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5,
                         adjust_lr_fn="match_rms_adamw")
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for x, y in zip(ours, theirs):
            x.grad = torch.randn(x.shape, generator=gen)
            y.grad = x.grad.clone()
        a.step()
        b.step()
        for x, y in zip(ours, theirs):
            assert torch.equal(x, y)
            assert torch.equal(a.state[x]["momentum_buffer"], b.state[y]["momentum_buffer"])


def test_an_expert_stack_is_its_matrices_one_by_one():
    (stack,), _ = _pair([(3, 16, 8)])
    singles = [nn.Parameter(stack.detach()[e].clone()) for e in range(3)]
    stack.grad = torch.randn(3, 16, 8, generator=torch.Generator().manual_seed(2))
    for e, p in enumerate(singles):
        p.grad = stack.grad[e].clone()
    for params in ([stack], singles):
        Muon(params, lr=0.01, weight_decay=0.1, momentum=0.95, nesterov=False, ns_steps=5).step()
    assert all(torch.equal(stack[e], singles[e]) for e in range(3))


def test_a_step_flagged_non_finite_leaves_weights_and_momentum_as_they_were():
    ours, _ = _pair([(16, 8), (8, 8)])
    opt = Muon(ours, lr=0.01, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5)
    for p in ours:
        p.grad = torch.ones_like(p)
    opt.step()
    before = [p.detach().clone() for p in ours]
    bufs = [opt.state[p]["momentum_buffer"].clone() for p in ours]
    ours[0].grad = torch.full_like(ours[0], float("nan"))
    opt.found_inf = torch.ones(())
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ours, before))
    assert all(torch.equal(opt.state[p]["momentum_buffer"], b) for p, b in zip(ours, bufs))


def test_muon_takes_the_block_matrices_and_adamw_the_rest():
    spec = get_model_spec("qwen3_moe")
    with torch.device("meta"):
        model = spec.build(model_args(spec, "debugmodel", 0, 32))
    names = {id(p): n for n, p in model.named_parameters()}
    muon, adamw = (sorted(names[id(p)] for p in ps) for ps in split_params(model, ["attention", "experts"]))
    assert {n.split(".", 2)[2] for n in muon} == {"attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                                                  "attention.wo.weight", "moe.experts.w1", "moe.experts.w2",
                                                  "moe.experts.w3"}
    assert "layers.0.moe.router.gate.weight" in adamw and "layers.0.attention.q_norm.weight" in adamw
    assert {"tok_embeddings.weight", "output.weight", "norm.weight"} <= set(adamw)
    # DeepSeek-V3: the shared experts are a dense feed-forward; the MTP depth's block is a block
    spec = get_model_spec("deepseek_v3")
    with torch.device("meta"):
        model = spec.build(model_args(spec, "debugmodel", 0, 32))
    names = {id(p): n for n, p in model.named_parameters()}
    muon, adamw = (set(names[id(p)] for p in ps) for ps in split_params(model, ["attention", "feed_forward"]))
    assert {"layers.1.moe.shared.w1.weight", "mtp.0.block.moe.shared.w2.weight", "mtp.0.block.attention.wkv_b.weight",
            "layers.0.feed_forward.w3.weight"} <= muon
    assert {"mtp.0.eh_proj.weight", "mtp.0.block.moe.router.gate.weight", "mtp.0.block.attention.kv_norm.weight",
            "layers.1.moe.experts.w1"} <= adamw


def test_every_muon_update_matches_one_process_and_each_matrix_is_orthogonalised_once():
    # FSDP x TP, HSDP, pipeline x FSDP; then experts under EP x FSDP and pipeline x EP
    assert_grad_parity("llama3", 4, ["2", "2", "muon", "+", "2", "1", "rep=2", "muon", "+",
                                     "pp", "2", "2", "1", "1F1B", "muon"])
    assert_grad_parity("qwen3_moe", 4, ["2", "2", "ep=2", "muon", "+", "pp", "2", "2", "1", "1F1B", "ep=2", "muon"])


MUON = [*TINY, "--optimizer.name", "Muon", "--training.global_batch_size", "8"]


def _job(nproc: int, steps: int, *extra: str) -> list[str]:
    # constant LR after warm-up: a 6-step job is the first steps of a 10-step one
    return [*MUON, "--lr_scheduler.decay_ratio", "0", "--checkpoint.enable", "--checkpoint.interval", "3",
            "--training.steps", str(steps), "--training.local_batch_size", str(8 // nproc), *extra]


def test_muon_matches_one_process_resumes_bitwise_and_its_momentum_reshards(tmp_path):
    """tp 2 follows one process for 10 steps (saving steps 3, 6, 9, 10) and resumes step 6 bit for bit;
    dp 2 loads the tp 2 step 3 and dp 1 the dp 2 step 6 with the same tensors (re-saved right after
    loading) and the same losses."""
    tp2 = ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8"]
    straight = train(2, _job(2, 10, *tp2), dump=tmp_path / "straight")
    assert_parity(train(1, _job(1, 10), dump=tmp_path / "one").losses, straight.losses)
    src = tmp_path / "straight" / "checkpoint"
    shutil.copytree(src / "step-6", tmp_path / "resumed" / "checkpoint" / "step-6")
    resumed = train(2, _job(2, 10, *tp2), dump=tmp_path / "resumed")
    assert resumed.losses == straight.losses[6:]
    assert_same_tensors(src / "step-10", tmp_path / "resumed" / "checkpoint" / "step-10")

    shutil.copytree(src / "step-3", tmp_path / "dp2" / "checkpoint" / "step-3")
    dp2 = hooked(2, _job(2, 6), tmp_path / "dp2", "resave")
    assert_same_tensors(src / "step-3", tmp_path / "dp2" / "checkpoint-resaved" / "step-3", rng=False)
    shutil.copytree(tmp_path / "dp2" / "checkpoint" / "step-6", tmp_path / "dp1" / "checkpoint" / "step-6")
    dp1 = hooked(1, _job(1, 9), tmp_path / "dp1", "resave")
    assert_same_tensors(tmp_path / "dp2" / "checkpoint" / "step-6", tmp_path / "dp1" / "checkpoint-resaved" / "step-6",
                        rng=False)
    for want, got in zip(straight.losses[3:9], dp2.losses + dp1.losses, strict=True):
        assert abs(got - want) / want <= 1e-4, (straight.losses, dp2.losses, dp1.losses)
