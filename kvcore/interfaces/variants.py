"""Attention variants as code: a registered :class:`AttentionVariant` changes how a layer attends through two
small functions in FlexAttention's form, instead of through code in every backend.

- ``score_mod(score, b, h, q_idx, kv_idx) -> score``: rewrites one scaled score (after the layer's built-in
  soft-cap, before any mask);
- ``mask_mod(b, h, q_idx, kv_idx) -> bool``: False hides key ``kv_idx`` from query ``q_idx`` (ANDed with the
  causal mask and the layer's window, so a mask can only hide keys, never reveal a future one).

``b`` is the sequence's row in the call, ``h`` the query head, ``q_idx`` / ``kv_idx`` the absolute token
positions of the query and the key in their sequence (int64 tensors). The functions must be written with
tensor operations that broadcast, never Python control flow on the values: the reference backend evaluates
them densely on broadcast index tensors (``h`` as ``[H, 1, 1]``, ``q_idx`` as ``[1, n, 1]``, ``kv_idx`` as
``[1, 1, S]``), a compiled backend on scalars under ``vmap``; both must mean the same.

A variant is registered as a class (``kvcore_register_attention_variants``), selected by name
(``attention_variants = ["alibi"]`` / ``--attention-variant alibi``), takes its options from
``[variants.<name>]`` (TOML cannot hold both a key ``attention_variants`` and tables under it), and is bound
once per decoder layer (:meth:`AttentionVariant.bind`), which lets it depend on the layer (a local-global
pattern) and on the head count (ALiBi's slopes). An engine binds the variants its configuration selects to the
model's layers (``Engine.attention_layers``); the bound mods ride on each layer's
:class:`~kvcore.interfaces.layer_attention.LayerAttention` (``mods``); a backend serves them when its
capabilities declare ``variants_as_code`` (it evaluates any mod) or name the variant (it implements that
variant natively).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvcore.interfaces.options import unknown_options_error

__all__ = ["AttentionVariant", "BoundVariant", "LayerShape", "MaskMod", "ScoreMod", "apply_mods"]

#: ``(score, b, h, q_idx, kv_idx) -> score``
ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: ``(b, h, q_idx, kv_idx) -> bool tensor`` (True: visible)
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerShape:
    """What a variant may depend on when it is bound to one decoder layer."""

    layer_idx: int
    num_layers: int
    num_heads: int  # query heads H
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True, eq=False)
class BoundVariant:
    """One variant's functions for one layer (at least one of them set)."""

    name: str  # the registered name, as capabilities and reasons spell it
    score_mod: ScoreMod | None = None
    mask_mod: MaskMod | None = None

    def __post_init__(self) -> None:
        if self.score_mod is None and self.mask_mod is None:
            raise ValueError(f"attention variant '{self.name}' bound neither a score_mod nor a mask_mod")


class AttentionVariant(abc.ABC):
    """A registered attention variant. Subclass it, declare ``name`` (and ``description``), implement
    :meth:`bind`, and register the class through ``kvcore_register_attention_variants``."""

    name: ClassVar[str]  # what attention_variants = [...] selects it by; unique among registered variants
    description: ClassVar[str] = ""  # one line for listings

    def __init__(self, **options: Any) -> None:
        """``options`` come from the ``[variants.<name>]`` table of the config file."""
        if options:
            raise unknown_options_error("attention variant", self.name, "variants", type(self), options)

    @classmethod
    def availability(cls) -> str | None:
        """None: usable here (the registry asks every plugin kind); a reason otherwise."""
        return None

    @abc.abstractmethod
    def bind(self, shape: LayerShape) -> BoundVariant | None:
        """This variant's functions for the layer ``shape`` describes; None: the layer attends without it."""


def apply_mods(
    mods: tuple[BoundVariant, ...], scores: torch.Tensor, visible: torch.Tensor,
    b: torch.Tensor | int, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every mod of ``mods`` evaluated eagerly and densely, in order: ``scores`` (soft-capped, not yet masked)
    rewritten by each ``score_mod``, ``visible`` (bool, True: the causal / window mask lets the key through)
    ANDed with each ``mask_mod``. ``b``, ``h``, ``q_idx``, ``kv_idx`` are int64 index tensors shaped to broadcast
    against ``scores`` (e.g. ``[H, 1, 1]``, ``[1, n, 1]``, ``[1, 1, S]`` for scores ``[H, n, S]``)."""
    for mod in mods:
        if mod.score_mod is not None:
            scores = mod.score_mod(scores, b, h, q_idx, kv_idx)
        if mod.mask_mod is not None:
            visible = visible & mod.mask_mod(b, h, q_idx, kv_idx)
    return scores, visible
