"""gpt-oss family: flavors with the published shapes, and the spec the framework loads."""

from titanlite.layers.moe import AUX_LOSS, post_step_hooks
from titanlite.model_spec import ModelSpec

from .hf import ADAPTER
from .model import ModelArgs, Transformer, alternating, gpt_oss_moe
from .parallelize import check_layout, tp_plan

# Shapes of the released openai/gpt-oss-20b and openai/gpt-oss-120b config.json: 64 query heads and
# 8 KV heads of 64, biases on q/k/v/o, sinks, a 128-key window on even blocks, YaRN (x32 over 4096
# positions, theta 150000), experts 2880 wide, top 4; they differ in depth and expert count.
_RELEASED = dict(dim=2880, n_heads=64, n_kv_heads=8, head_dim=64)

flavors = {
    # 8 experts of width 128, top 2, 16-key windows: windows matter at the tests' 64 tokens
    "debugmodel": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32, vocab_size=512,
                            max_seq_len=4096, sliding_window=16, layer_types=alternating(4),
                            moe=gpt_oss_moe(8, hidden=128, top_k=2)),
    "20B": ModelArgs(**_RELEASED, n_layers=24, layer_types=alternating(24), moe=gpt_oss_moe(32)),
    "120B": ModelArgs(**_RELEASED, n_layers=36, layer_types=alternating(36), moe=gpt_oss_moe(128)),
}


def activated_params(args: ModelArgs) -> int:
    """Parameters one token passes through, the input embedding excluded (the model card's
    "active" count): attention with its biases and sinks, the router, top_k experts, the output."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    attn = 2 * args.dim * q + 2 * args.dim * kv + q + 2 * kv + args.dim + args.n_heads
    m = args.moe
    expert = 3 * args.dim * m.hidden + 2 * m.hidden + args.dim
    router = args.dim * m.num_experts + m.num_experts
    return args.n_layers * (attn + 2 * args.dim + router + m.top_k * expert) + args.dim * args.vocab_size


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """6 x the activated parameters + the attention scores, each sliding block over its window
    rather than the whole sequence."""
    keys = sum(min(seq_len, args.window(i) or seq_len) for i in range(args.n_layers))
    return 6 * activated_params(args) + 12 * args.n_heads * args.head_dim * keys


SPEC = ModelSpec(name="gpt_oss", flavors=flavors, build=Transformer, tp_plan=tp_plan,
                 flops_per_token=flops_per_token, check_layout=check_layout, hf=ADAPTER,
                 post_step_hooks=post_step_hooks, extra_losses=(AUX_LOSS,))
