"""The decoder's stateless pieces: RMSNorm, the MLP activations and each layer's attention spec from the
model configuration (and the registered attention variants an engine binds to each layer)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvcore.errors import PluginError
from kvcore.interfaces.layer_attention import LayerAttention
from kvcore.interfaces.variants import AttentionVariant, BoundVariant, LayerShape
from kvcore.model.config import ModelConfig

__all__ = ["rms_norm", "add_rms_norm", "ACTIVATIONS", "attention_layers", "bind_variants"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight``, the statistics in float32 (as Hugging Face Llama does).

    One ``F.rms_norm`` call computes ``x * rsqrt(mean(x²) + eps)`` (on CPU ATen runs the same elementwise
    ops from C++, without a Python dispatch between each); in float32 (weight included) it gives bitwise
    the values of spelling the ops out (tests/model/test_model_ops.py). A narrower dtype keeps Hugging Face's
    rounding: normalised in float32, rounded to the dtype, then scaled by the weight."""
    shape = (x.shape[-1],)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, shape, weight, eps)
    normed = F.rms_norm(x.float(), shape, None, eps).to(x.dtype)  # a new tensor
    if weight.dtype != normed.dtype:
        return weight * normed  # type promotion
    return normed.mul_(weight)  # in place (no allocation): same values as ``weight * normed``


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, fused: bool = False
) -> torch.Tensor:
    """``rms_norm(h + delta)``, ``h`` updated to ``h + delta`` in place (``delta`` None: no add): a residual add
    and the next norm. ``fused``: one call of kvcore's kernel (``csrc/rms_norm.cpp``; bfloat16 or float32 ``[T, d]``,
    the kernels loaded) instead of a dozen eager ops; the same rounding steps, a sum of squares in another order (a
    value may differ by one step of the dtype)."""
    if fused and h.dtype == weight.dtype and h.dtype in (torch.bfloat16, torch.float32) and h.dim() == 2:
        return torch.ops.kvcore.rms_norm(h, delta, weight, eps)
    if delta is not None:
        h.add_(delta)
    return rms_norm(h, weight, eps)


#: the MLP activations by Hugging Face's ``hidden_act`` name
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def attention_layers(c: ModelConfig, max_positions: int) -> tuple[LayerAttention, ...]:
    """Each layer's attention: the scale, the soft-cap, and the sliding window where it is shorter than
    ``max_positions`` (a longer one hides no key this instance can hold)."""
    scale = (c.query_pre_attn_scalar or c.head_dim) ** -0.5
    layers = []
    for i in range(c.num_hidden_layers):
        window = c.layer_window(i)
        window = window if window is not None and window < max_positions else None
        layers.append(LayerAttention(scale, sliding_window=window, softcap=c.attn_logit_softcapping))
    return tuple(layers)


def bind_variants(
    layers: Sequence[LayerAttention], variants: Sequence[AttentionVariant], *, num_heads: int, num_kv_heads: int,
    head_dim: int,
) -> tuple[LayerAttention, ...]:
    """``layers`` (a model's) with each of ``variants`` bound to each layer, in order, as its mods; a variant whose
    ``bind`` raises or returns something else than its own :class:`BoundVariant` is a PluginError."""
    bound = []
    for i, layer in enumerate(layers):
        shape = LayerShape(i, len(layers), num_heads, num_kv_heads, head_dim)
        mods = []
        for variant in variants:
            try:
                mod = variant.bind(shape)
            except Exception as exc:
                raise PluginError(f"attention variant '{variant.name}' failed to bind layer {i}: "
                                  f"{type(exc).__name__}: {exc}") from exc
            if mod is not None and not (isinstance(mod, BoundVariant) and mod.name == variant.name):
                raise PluginError(f"attention variant '{variant.name}' bound layer {i} to {mod!r}, not a "
                                  f"BoundVariant named '{variant.name}'")
            mods += [mod] if mod is not None else []
        bound.append(dataclasses.replace(layer, mods=layer.mods + tuple(mods)))
    return tuple(bound)
