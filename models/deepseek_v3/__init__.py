"""DeepSeek-V3 family (Moonlight, DeepSeek-V3, Kimi K2): flavors with the published shapes, and
the spec the framework loads."""

import dataclasses

from titanlite.layers.moe import AUX_LOSS, MoEArgs, post_step_hooks
from titanlite.layers.mtp import MTP_LOSS
from titanlite.layers.rope import YaRN
from titanlite.model_spec import ModelSpec

from .hf import ADAPTER
from .model import ModelArgs, Transformer
from .parallelize import check_layout, tp_plan


def _moe(experts: int, top_k: int, hidden: int, shared: int, scaling: float, n_group: int = 1,
         topk_group: int = 1) -> MoEArgs:
    """Sigmoid routing, renormalised top-k, the sequence-wise auxiliary loss when switched on."""
    return MoEArgs(num_experts=experts, top_k=top_k, hidden=hidden, shared_hidden=shared * hidden,
                   score_func="sigmoid", n_group=n_group, topk_group=topk_group, routed_scaling_factor=scaling,
                   aux_loss_per_sequence=True)


# The shapes of the released config.json files: moonshotai/Moonlight-16B-A3B,
# deepseek-ai/DeepSeek-V3 and moonshotai/Kimi-K2-Instruct.
flavors: dict[str, ModelArgs] = {
    # three blocks (the first dense), group-limited routing over 4 groups of 2 experts, a query
    # bottleneck, YaRN with DeepSeek's mscale, one MTP depth: every feature, CPU-test sized
    "debugmodel": ModelArgs(dim=128, n_layers=3, n_heads=4, n_kv_heads=4, vocab_size=512, q_lora_rank=64,
                            kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                            ffn_hidden=256, n_dense_layers=1, moe=_moe(8, 2, 64, 1, 2.5, n_group=4, topk_group=2),
                            yarn=YaRN(factor=4.0, original_max_seq_len=512, mscale=1.0, mscale_all_dim=1.0),
                            mtp_layers=1, max_seq_len=2048),
    "16B": ModelArgs(dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, vocab_size=163840, q_lora_rank=0,
                     ffn_hidden=11264, n_dense_layers=1, moe=_moe(64, 6, 1408, 2, 2.446), norm_eps=1e-5,
                     rope_theta=50000.0, max_seq_len=8192),
    "671B": ModelArgs(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, vocab_size=129280, q_lora_rank=1536,
                      ffn_hidden=18432, n_dense_layers=3, moe=_moe(256, 8, 2048, 1, 2.5, n_group=8, topk_group=4),
                      yarn=YaRN(factor=40.0, original_max_seq_len=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                                mscale_all_dim=1.0),
                      mtp_layers=1, max_seq_len=163840),
    "1T": ModelArgs(dim=7168, n_layers=61, n_heads=64, n_kv_heads=64, vocab_size=163840, q_lora_rank=1536,
                    ffn_hidden=18432, n_dense_layers=1, moe=_moe(384, 8, 2048, 1, 2.827),
                    yarn=YaRN(factor=32.0, original_max_seq_len=4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                              mscale_all_dim=1.0),
                    rope_theta=50000.0, max_seq_len=131072),
}

# ~100M activated parameters per token (output head counted for the MTP depth too), ~300M in
# all: DeepSeek-V3's proportions at Llama 3 100M's width, for CPU benchmarks (docs/benchmarks.md)
flavors["100M"] = ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=16384, q_lora_rank=0,
                            kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                            ffn_hidden=1536, n_dense_layers=1, moe=_moe(16, 2, 512, 1, 2.5, n_group=4, topk_group=2),
                            mtp_layers=1, max_seq_len=4096)
# its dense twin: every block (the MTP one included) a 1536-wide feed-forward, the MoE blocks'
# two routed experts + the shared one less their 768 x 16 router
flavors["100M_dense"] = dataclasses.replace(flavors["100M"], n_dense_layers=13)
# benchmark twin (docs/benchmarks.md): every block and the MTP one dense, 210 wide, so the same
# feed-forward weights per token as the debug model's dense block + 3 x (router, top 2 + shared)
flavors["debugmodel_dense"] = dataclasses.replace(flavors["debugmodel"], n_dense_layers=4, ffn_hidden=210)


def _attention_params(args: ModelArgs) -> int:
    """Matmul weights of one MLA block (norms left out)."""
    q = (args.dim * args.q_lora_rank + args.q_lora_rank * args.n_heads * args.head_dim if args.q_lora_rank
         else args.dim * args.n_heads * args.head_dim)
    kv = args.dim * (args.kv_lora_rank + args.qk_rope_head_dim)
    kv += args.kv_lora_rank * args.n_heads * (args.qk_nope_head_dim + args.v_head_dim)
    return q + kv + args.n_heads * args.v_head_dim * args.dim


def activated_params(args: ModelArgs) -> int:
    """Matmul weights one token passes through, input embedding excluded; the MTP depths (each
    with its projection, block and another pass through the output head) included."""
    moe = args.dim * args.moe.num_experts + 3 * args.dim * (args.moe.top_k * args.moe.hidden + args.moe.shared_hidden)
    n_moe = args.n_layers - args.n_dense_layers + args.mtp_layers
    blocks = (args.n_layers + args.mtp_layers) * _attention_params(args) + n_moe * moe
    blocks += args.n_dense_layers * 3 * args.dim * args.ffn_hidden
    return blocks + args.mtp_layers * 2 * args.dim * args.dim + (1 + args.mtp_layers) * args.dim * args.vocab_size


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """6 x activated weights + causal attention (scores over qk dims, values over v dims), MTP included."""
    depth = args.n_layers + args.mtp_layers
    return 6 * activated_params(args) + 6 * depth * args.n_heads * (args.head_dim + args.v_head_dim) * seq_len


SPEC = ModelSpec(name="deepseek_v3", flavors=flavors, build=Transformer, tp_plan=tp_plan,
                 flops_per_token=flops_per_token, check_layout=check_layout, hf=ADAPTER,
                 post_step_hooks=post_step_hooks, extra_losses=(AUX_LOSS, MTP_LOSS), tp_replicated_losses=(MTP_LOSS,),
                 post=("norm", "output", "mtp", "mtp_embeddings"))
