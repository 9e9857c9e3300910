"""Qwen3 dense family: flavors with the published shapes, and the spec the framework loads."""

from titanlite.layers.decoder import dense_flops_per_token
from titanlite.model_spec import ModelSpec

from .hf import ADAPTER
from .model import ModelArgs, Transformer
from .parallelize import tp_plan

# Shapes of the released Qwen/Qwen3-* configs (rope_theta 1e6, rms eps 1e-6, 40960 positions).
# The sizes up to 4B tie the output projection to the embeddings.
flavors = {
    # head_dim 64 != dim / n_heads on purpose, so the debug model exercises the explicit head_dim
    "debugmodel": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, ffn_hidden=768,
                            vocab_size=512, tie_embeddings=True),
    "0.6B": ModelArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden=3072, tie_embeddings=True),
    "1.7B": ModelArgs(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden=6144, tie_embeddings=True),
    "4B": ModelArgs(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden=9728, tie_embeddings=True),
    "8B": ModelArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden=12288),
    "14B": ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_hidden=17408),
    "32B": ModelArgs(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_hidden=25600),
}


SPEC = ModelSpec(name="qwen3", flavors=flavors, build=Transformer, tp_plan=tp_plan,
                 flops_per_token=dense_flops_per_token, hf=ADAPTER)
