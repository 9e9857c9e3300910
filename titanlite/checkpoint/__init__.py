"""Checkpoints: DTensor-native torch.distributed.checkpoint save, load and reshard (dcp), and
Hugging Face safetensors import and export (hf)."""
