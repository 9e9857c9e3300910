"""Qwen3.5 family (hybrid linear attention; dense and MoE, text only): flavors with the shapes
of transformers' default configs, and the spec the framework loads."""

from titanlite.layers import decoder, linear_attention
from titanlite.layers.moe import AUX_LOSS, MoEArgs, post_step_hooks
from titanlite.model_spec import ModelSpec

from .hf import ADAPTER
from .model import ModelArgs, Transformer, hybrid_layers
from .parallelize import check_layout, tp_plan

_DEBUG = dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, ffn_hidden=768, vocab_size=512,
              linear_k_heads=4, linear_v_heads=8, linear_k_head_dim=32, linear_v_head_dim=32,
              layer_types=hybrid_layers(4))
flavors = {
    # qwen3's debugmodel width (dim 256, 8 x 64 attention heads), three linear blocks and one full
    "debugmodel": ModelArgs(**_DEBUG),
    "debugmodel_moe": ModelArgs(**_DEBUG | dict(ffn_hidden=0), moe=MoEArgs(num_experts=8, top_k=2, hidden=128, shared_hidden=128,
                                                      shared_gate=True)),
    # transformers' Qwen3_5TextConfig() and Qwen3_5MoeTextConfig() defaults
    "9B": ModelArgs(dim=4096, n_layers=32, n_heads=16, n_kv_heads=4, layer_types=hybrid_layers(32)),
    "35B-A3B": ModelArgs(dim=2048, n_layers=40, n_heads=16, n_kv_heads=2, ffn_hidden=0, layer_types=hybrid_layers(40),
                         moe=MoEArgs(num_experts=256, top_k=8, hidden=512, shared_hidden=512, shared_gate=True)),
}


def mixer_params(args: ModelArgs, layer: int) -> int:
    """Weights of block `layer`'s token mixer (projections; norms and per-head scalars aside)."""
    if args.layer_type(layer) == "full_attention":
        return decoder.attention_params(args) + args.dim * args.n_heads * args.head_dim  # + the gate
    k, v = args.linear_k_heads * args.linear_k_head_dim, args.linear_v_heads * args.linear_v_head_dim
    return args.dim * (2 * k + 3 * v + 2 * args.linear_v_heads)


def activated_params(args: ModelArgs) -> int:
    """Parameters one token passes through, embeddings excluded (the output projection counts)."""
    if args.moe is None:
        ffn = 3 * args.dim * args.ffn_hidden
    else:
        m = args.moe
        ffn = args.dim * m.num_experts + 3 * args.dim * (m.top_k * m.hidden + m.shared_hidden) + args.dim * m.shared_gate
    return sum(mixer_params(args, i) + ffn for i in range(args.n_layers)) + args.dim * args.vocab_size


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 x activated parameters, + causal softmax scores in the
    full-attention blocks (as titanlite.layers.decoder counts them), + the gated delta rule in
    the linear ones, which does not grow with the sequence (titanlite.layers.linear_attention)."""
    full = sum(args.layer_type(i) == "full_attention" for i in range(args.n_layers))
    per_linear = args.linear_v_heads * linear_attention.flops_per_token(args.linear_k_head_dim,
                                                                        args.linear_v_head_dim, args.chunk_size)
    return (6 * activated_params(args) + 12 * full * args.n_heads * args.head_dim * seq_len
            + (args.n_layers - full) * per_linear)


SPEC = ModelSpec(name="qwen3_5", flavors=flavors, build=Transformer, tp_plan=tp_plan,
                 flops_per_token=flops_per_token, check_layout=check_layout, hf=ADAPTER,
                 post_step_hooks=post_step_hooks, extra_losses=(AUX_LOSS,))
