"""What model families share: the attention seam and the attention layer, RoPE, the gated
feed-forward, the mixture-of-experts layer, the decoder they are assembled into, and the
per-name initialisation."""
