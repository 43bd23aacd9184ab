"""Sampling: the default sampler, the logits processors it is built from, and the acceptance rules of
speculative decoding (``rejection``)."""
