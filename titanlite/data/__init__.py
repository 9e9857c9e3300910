"""Training data: tokenizers, sources, the layout-independent sample order and its loader,
the streamed loader, and the validation loss."""
