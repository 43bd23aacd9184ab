"""The shapes of kvcore's CPU operators for ``torch.compile`` (fake implementations: what a traced graph needs to
know of an operator without running it). :func:`~kvcore.kernels.cpu_kernels.load_kernels` registers them once the
library has defined the operators."""

from __future__ import annotations

import torch

__all__ = ["register_fakes"]


def register_fakes() -> None:
    """Register the fake implementation of every operator a compiled step may trace."""
    for op in ("decode_attention", "cached_decode_attention", "prefill_attention", "rms_norm", "fused_mlp",
               "decode_stack"):
        torch.library.register_fake(f"kvcore::{op}")(_shaped_like_first)
    torch.library.register_fake("kvcore::int4_linear")(_rows_of_16)
    torch.library.register_fake("kvcore::int8_group_linear")(_rows_of_16)
    torch.library.register_fake("kvcore::bf16_linear")(_bf16_linear)
    torch.library.register_fake("kvcore::fused_qkv")(_fused_qkv)


def _shaped_like_first(first, *args):
    return torch.empty_like(first)


def _bf16_linear(x, packed):
    return x.new_empty(x.shape[0], packed.shape[0] * 16)


def _rows_of_16(x, codes, dm):
    return x.new_empty(x.shape[0], codes.shape[0] * 16)


def _fused_qkv(h, delta, norm_weight, eps, packed, *args):
    return h.new_empty(h.shape[0], packed.shape[0] * 16)
