"""Qwen3-MoE family: flavors with the published shapes, and the spec the framework loads."""

from titanlite.layers import decoder
from titanlite.layers.moe import AUX_LOSS, MoEArgs, post_step_hooks
from titanlite.model_spec import ModelSpec

from .hf import ADAPTER
from .model import ModelArgs, Transformer
from .parallelize import check_layout, tp_plan

# Shapes of the released Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B configs: every block is
# MoE (128 experts, top 8, renormalised), no shared expert, untied, rope_theta 1e6, 40960 positions.
flavors = {
    # 8 experts of width 128, top 2: small enough for CPU tests, sparse enough to route unevenly
    "debugmodel": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, ffn_hidden=768,
                            vocab_size=512, moe=MoEArgs(num_experts=8, top_k=2, hidden=128)),
    # benchmark shapes (docs/benchmarks.md): 107.5M parameters, 32.0M activated per token, and a
    # dense twin with the same attention whose feed-forward is as wide as the top-2 experts together
    "bench100m": ModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64, ffn_hidden=2048,
                           vocab_size=512, moe=MoEArgs(num_experts=8, top_k=2, hidden=1024)),
    "bench100m_dense": ModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64, ffn_hidden=2048,
                                 vocab_size=512, moe=MoEArgs(num_experts=8, top_k=2, hidden=1024),
                                 dense_layers=tuple(range(8))),
    "30B-A3B": ModelArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_hidden=6144,
                         moe=MoEArgs(num_experts=128, top_k=8, hidden=768)),
    "235B-A22B": ModelArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_hidden=12288,
                           moe=MoEArgs(num_experts=128, top_k=8, hidden=1536)),
}


def activated_params(args: ModelArgs) -> int:
    """Parameters one token passes through, embeddings excluded (the output projection counts)."""
    attn = decoder.attention_params(args)
    moe = args.dim * args.moe.num_experts + 3 * args.dim * (args.moe.top_k * args.moe.hidden + args.moe.shared_hidden)
    dense = 3 * args.dim * args.ffn_hidden
    n_dense = len(args.dense_layers)
    return args.n_layers * attn + n_dense * dense + (args.n_layers - n_dense) * moe + args.dim * args.vocab_size


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token of the activated parameters only."""
    return decoder.flops_per_token(args, seq_len, activated_params(args))


SPEC = ModelSpec(name="qwen3_moe", flavors=flavors, build=Transformer, tp_plan=tp_plan,
                 flops_per_token=flops_per_token, check_layout=check_layout, hf=ADAPTER,
                 post_step_hooks=post_step_hooks, extra_losses=(AUX_LOSS,))
