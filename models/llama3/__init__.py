"""Llama 3 family: flavors with the published shapes, and the spec the framework loads."""

from titanlite.layers.decoder import dense_flops_per_token
from titanlite.model_spec import ModelSpec

from .hf import ADAPTER
from .model import ModelArgs, Transformer
from .parallelize import tp_plan

_LLAMA31 = dict(rope_scaling_factor=8.0)
_LLAMA32 = dict(rope_scaling_factor=32.0, tie_embeddings=True)

flavors = {
    "debugmodel": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=512,
                            multiple_of=64, rope_scaling_factor=8.0),
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, **_LLAMA32),
    "3B": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, **_LLAMA32),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
                    multiple_of=1024, **_LLAMA31),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
                     multiple_of=4096, **_LLAMA31),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
                      multiple_of=4096, **_LLAMA31),
    # the debug model with the 1B/3B embedding tying, to test tying under every layout
    "debugmodel_tied": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=512,
                                 multiple_of=64, rope_scaling_factor=8.0, tie_embeddings=True),
    # Mistral- and gpt-oss-style attention on the debug model, to test the attention seam under
    # every layout: 16-key windows on alternate layers, learned sinks in all
    "debugmodel_swa": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=512, multiple_of=64,
                                rope_scaling_factor=8.0, sliding_window=16, attn_sinks=True,
                                layer_types=("sliding_attention", "full_attention") * 2),
    # ~100M parameters (vocab 16384): big enough that CPU benchmarks are matmul-bound
    "100M": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=16384, multiple_of=256),
}


SPEC = ModelSpec(name="llama3", flavors=flavors, build=Transformer, tp_plan=tp_plan,
                 flops_per_token=dense_flops_per_token, hf=ADAPTER)
