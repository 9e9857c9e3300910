"""What model families share: the attention seam, the mixture-of-experts layer, and the
per-name initialisation."""
