"""Sampling: the default sampler and the logits processors it is built from."""
