"""titanlite: a small, readable, PyTorch-native LLM pre-training framework."""
