"""How one decoder layer attends (:class:`LayerAttention`): the scale and the variants beyond plain causal
attention (a sliding window, logit soft-capping, attention sinks, and registered variants written as code,
:mod:`kvcore.interfaces.variants`). The model declares one per layer, the engine binds the registered variants it
selects to them, the per-step metadata carries them, and a backend declares the variants it serves per phase."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcore.interfaces.variants import BoundVariant

__all__ = ["VARIANTS", "LayerAttention", "variants_of"]

#: the attention variants beyond plain causal attention, by the name capabilities use -> what a reason says is
#: missing ("no soft-capping")
VARIANTS = {"sliding_window": "sliding windows", "softcap": "soft-capping", "sinks": "attention sinks"}


@dataclass(frozen=True, eq=False)
class LayerAttention:
    """How one decoder layer attends (every layer is causal). For query ``i`` at absolute position ``p_i``
    and key ``j`` at position ``p_j``:

    1. ``s_ij = scale · q_i · k_j`` (``scale``: ``1 / √head_dim``, or Gemma's ``query_pre_attn_scalar ** -0.5``);
    2. with ``softcap = c``: ``s_ij = c · tanh(s_ij / c)``, before any mask (Gemma 2);
    3. key ``j`` is visible when ``p_j <= p_i`` and, with ``sliding_window = W``, ``p_i - p_j < W``: the query
       and the ``W - 1`` keys before it (Hugging Face's ``sliding_window``; flash-attn's ``window_size =
       (W - 1, 0)``); invisible scores are ``-∞``;
    2b. each of ``mods`` (registered variants bound to this layer) in order: ``s_ij = score_mod(s_ij, b, h, p_i,
       p_j)``, and key ``j`` is hidden where its ``mask_mod(b, h, p_i, p_j)`` is False;
    4. ``P = softmax`` over the visible keys and, with ``sinks`` (``[H]`` float32, one learned logit per query
       head, GPT-OSS), that head's sink logit as one more entry that weights no value;
    5. ``o_i = Σ_j P_ij v_j``.
    """

    scale: float  # softmax scale on q · k (1 / sqrt(head_dim) unless the model sets its own)
    sliding_window: int | None = None  # tokens a query sees, itself included (None: the whole sequence)
    softcap: float | None = None  # c of c · tanh(s / c) on the scaled scores
    sinks: torch.Tensor | None = None  # [H] float32, one logit per query head
    mods: tuple[BoundVariant, ...] = ()  # registered variants bound to this layer, applied in order

    def __post_init__(self) -> None:
        window, cap = self.sliding_window, self.softcap
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, got {window!r}")
        if cap is not None and not (isinstance(cap, (int, float)) and math.isfinite(cap) and cap > 0):
            raise ValueError(f"softcap must be a finite number > 0 or None, got {cap!r}")
        if self.sinks is not None and (self.sinks.dim() != 1 or not self.sinks.is_floating_point()):
            raise ValueError(f"sinks must be a 1-D float tensor [num_heads], got {tuple(self.sinks.shape)}")
        names = [mod.name for mod in self.mods]
        if len(set(names)) != len(names) or set(names) & set(VARIANTS):
            raise ValueError(f"mods must have distinct names other than the built-in variants, got {names}")

    @property
    def variants(self) -> frozenset[str]:
        """The :data:`VARIANTS` and registered variant names this layer uses (empty: plain causal attention)."""
        used = {"sliding_window": self.sliding_window is not None, "softcap": self.softcap is not None,
                "sinks": self.sinks is not None}
        return frozenset(name for name, on in used.items() if on) | {mod.name for mod in self.mods}

    def describe(self) -> str:
        parts = [f"scale {self.scale:.4g}"]
        if self.sliding_window is not None:
            parts.append(f"window {self.sliding_window}")
        if self.softcap is not None:
            parts.append(f"softcap {self.softcap:g}")
        if self.sinks is not None:
            parts.append("sinks")
        parts += [mod.name for mod in self.mods]
        return ", ".join(parts)


def variants_of(layers: Sequence[LayerAttention]) -> frozenset[str]:
    """Every variant any of ``layers`` uses."""
    return frozenset().union(*(layer.variants for layer in layers))
