"""The attention-variant dimension of the op tier: cases whose two layers use sliding windows, soft-caps and
sinks (:class:`~kvcore.interfaces.attention.LayerAttention`), checked against ``naive`` like every op case.

Each row is an ordinary op case (layout, head size, scenario, block size) plus a *pattern*: the two layers'
attention. The rows put the window edge where bugs live: a window smaller than a block, equal to the
block size, crossing block boundaries and the chunk boundaries of the ``mixed`` scenario (13-token chunks
at several offsets), window 1 (the query alone), decode far past the window (``ragged`` decodes a 33-token
prompt), soft-cap values that bite (1.5) and that barely do (30), per-head sinks in prefill and decode,
and a layer pattern mixing a windowed soft-capped layer with a global one with sinks. A backend that does
not declare a pattern's variants for both phases skips the case with the reason.

Long windowed contexts (:data:`LONG_ROWS`, one row per precision the run certifies: float32, bfloat16,
float16): the ``long2k`` scenario (2,103 keys, past every decode-path switch a backend may make at a few
hundred or a thousand keys: split-KV, chunked kernels) with windows of 1,000 and 61 keys. Its decode rows
at positions 2,100-2,102 see windows starting at keys 1,101-1,103 and 2,040-2,042 (inside a block of 12
or 16 keys and a 64-key chunk), its 1,000- and 1,030-token prefill chunks have window starts sweeping
from the cache into the chunk, and positions pass 256 and 2,048, where bfloat16 and float16 stop holding
integers exactly: a backend that forgets the window on its long-context path, or computes window bounds
from positions in the model dtype, fails there. The reference masks from int64 positions
(:func:`~kvcore.interfaces.attention.causal_mask`).

Variants as code (:mod:`kvcore.interfaces.variants`): :data:`MOD_ROWS` run the suite's own :class:`Probe`
variant in every run, and each variant the run selects (``--attention-variant``), bound to the two layers on
top of a plain and a windowed, soft-capped pattern. The probe's ``score_mod`` depends on the head, the
sequence's row and both positions, and maps ``-∞`` to a finite score (applied after the mask, it reveals the
masked keys); its ``mask_mod`` punches holes in the second layer only (off by one, other keys go).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcore.conformance.cases import BLOCK_SIZE, OpCase, dtype_suffix, on_caches
from kvcore.interfaces.layer_attention import LayerAttention, variants_of
from kvcore.interfaces.variants import AttentionVariant, BoundVariant, LayerShape
from kvcore.model.layers import bind_variants

__all__ = ["PATTERNS", "LONG_ROWS", "MOD_ROWS", "Probe", "VariantOpCase", "variant_cases", "case_layers"]

#: pattern -> per layer (sliding window, soft-cap, sinks?) of the two op-tier layers
PATTERNS: dict[str, tuple[tuple[int | None, float | None, bool], ...]] = {
    "window7": ((7, None, False), (7, None, False)),  # smaller than a block
    "window16": ((BLOCK_SIZE, None, False), (None, None, False)),  # equal to the block size; a global layer
    "window20": ((20, None, False), (20, None, False)),  # crossing block and chunk boundaries
    "window1": ((1, None, False), (1, None, False)),  # the query alone
    "softcap": ((None, 1.5, False), (None, 30.0, False)),
    "window13-softcap": ((13, 1.5, False), (13, 1.5, False)),
    "sinks": ((None, None, True), (None, None, True)),
    "mixed": ((5, 2.0, False), (None, None, True)),  # a local soft-capped layer, a global one with sinks
    # long contexts: a wide window and a narrow one, both starting mid-block and mid-chunk (LONG_ROWS)
    "window1000-window61": ((1000, None, False), (61, None, False)),
    "plain": ((None, None, False), (None, None, False)),  # under registered variants only (MOD_ROWS)
}

#: (layout, head_dim, scenario, block_size, pattern)
ROWS = (
    ("gqa", 64, "ragged", 16, "window7"),
    ("gqa", 64, "ragged", 16, "window16"),
    ("mqa", 32, "mixed", 12, "window20"),
    ("gqa8x4", 64, "continue", 8, "window20"),
    ("mha", 64, "fork", 8, "window1"),
    ("gqa6x2", 40, "ragged", 16, "softcap"),
    ("gqa", 64, "mixed", 16, "window13-softcap"),
    ("gqa", 64, "continue", 16, "sinks"),
    ("mqa", 64, "ragged", 1, "mixed"),
    ("gqa", 128, "fragmented", 16, "window16"),
)

#: the rows each variant as code runs on (same columns as ROWS): decodes and chunks of several sequences
MOD_ROWS = (
    ("gqa", 64, "mixed", 12, "plain"),
    ("gqa6x2", 40, "ragged", 16, "window13-softcap"),
)


class Probe(AttentionVariant):
    """The suite's own variant as code (see the module docstring); not registered, always run."""

    name = "conformance-probe"
    description = "head-, row- and position-dependent scores; holes in the second layer's mask"

    def bind(self, shape: LayerShape) -> BoundVariant:
        slopes = 0.5 / torch.arange(1, shape.num_heads + 1)

        def score_mod(score, b, h, q_idx, kv_idx):
            return 3 * torch.tanh(score / 3) - slopes.to(score.device)[h] * (q_idx - kv_idx) * (1 + b % 2)

        def holes(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx) % 3 != 1

        return BoundVariant(self.name, score_mod=score_mod, mask_mod=holes if shape.layer_idx == 1 else None)


#: dtype -> the long windowed row run in that precision (same columns as ROWS); the layouts and block sizes
#: differ so the three rows cover more between them
LONG_ROWS = {
    torch.float32: ("gqa", 64, "long2k", 16, "window1000-window61"),
    torch.bfloat16: ("mqa6x1", 64, "long2k", 12, "window1000-window61"),
    torch.float16: ("gqa6x2", 80, "long2k", 16, "window1000-window61"),
}


@dataclass(frozen=True)
class VariantOpCase(OpCase):
    """An op case whose layers attend as :data:`PATTERNS` ``[pattern]`` says, with ``variants`` (as code)
    bound to them."""

    pattern: str = "window7"
    variants: tuple[AttentionVariant, ...] = ()

    @property
    def attention(self) -> str:
        """``window13-softcap``, or with variants as code ``window13-softcap+alibi``."""
        return "+".join((self.pattern, *(v.name for v in self.variants)))

    @property
    def id(self) -> str:
        suffix = dtype_suffix(self.dtype)  # stays last, as in every op case id
        return f"{super().id.removesuffix(suffix)}-{self.attention}{suffix}"

    def shapes(self) -> dict:
        return {**super().shapes(), "attention": self.attention}


def case_layers(case: OpCase, scale: float) -> tuple[LayerAttention, ...]:
    """The layers' attention of ``case`` (empty: a plain op case). Sinks are drawn from the case's seed."""
    pattern = getattr(case, "pattern", None)
    if pattern is None:
        return ()
    gen = torch.Generator().manual_seed(case.seed + 1)
    layers = []
    for window, softcap, sinks in PATTERNS[pattern]:
        logits = torch.randn(case.num_heads, generator=gen) * 2 if sinks else None  # some heads sink a lot
        layers.append(LayerAttention(scale, sliding_window=window, softcap=softcap, sinks=logits))
    variants = getattr(case, "variants", ())
    return bind_variants(layers, variants, num_heads=case.num_heads, num_kv_heads=case.num_kv_heads,
                         head_dim=case.head_dim)


def case_variants(case: OpCase) -> frozenset[str]:
    """The variants ``case`` needs a backend to serve (empty: a plain op case)."""
    return variants_of(case_layers(case, 1.0))


def variant_cases(
    kv_caches: tuple[str, ...] | None = None, dtypes: Sequence[torch.dtype] = (torch.float32,),
    selected: Sequence[AttentionVariant] = (),
) -> list[VariantOpCase]:
    """The variant rows (the same in quick and full runs: few, and all but the long ones short) in the run's
    first dtype, plus the long windowed row of each of ``dtypes`` (:data:`LONG_ROWS`) and the :data:`MOD_ROWS`
    of the :class:`Probe` and of each ``selected`` variant (the run's registered ones); once per cache under
    test when there are several (:func:`~kvcore.conformance.cases.on_caches`)."""
    rows = [VariantOpCase(layout, d, s, block_size=bs, pattern=p) for layout, d, s, bs, p in ROWS]
    for variant in (Probe(), *selected):
        rows += [VariantOpCase(layout, d, s, block_size=bs, pattern=p, variants=(variant,))
                 for layout, d, s, bs, p in MOD_ROWS]
    for dtype in dtypes:
        layout, d, s, bs, p = LONG_ROWS.get(dtype, LONG_ROWS[torch.float32])
        tag = None if len(dtypes) == 1 else dtype  # one dtype: the run's own, as op_cases tags it
        rows.append(VariantOpCase(layout, d, s, block_size=bs, dtype=tag, pattern=p))
    return on_caches(rows, kv_caches)
