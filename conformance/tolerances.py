"""Per-dtype tolerances of every comparison the suite makes. This module is the documented contract.

``OP``: attention output of the backend under test vs the float32 reference (``naive`` over a
``ContiguousKVCache``, fed the *same* rounded q/k/v upcast to float32). An element passes when
``|out - ref| <= atol + rtol * |ref|`` (``torch.isclose``), with, for a case of head size ``D`` whose
longest sequence has ``S`` keys::

    atol = rtol = C_IO * u(dtype) + C_ACC * sqrt(D + S) * u(float32)        (op_tolerance)

``u`` is the unit roundoff (half an ulp at 1: float32 2^-24, float16 2^-11, bfloat16 2^-8). The
contract is that a backend *stores and exchanges* values in the model dtype (scores, probabilities or
the output may each be rounded to it once: a few roundings of O(1) values, hence ``C_IO * u(dtype)``,
``C_IO = 6``) but *accumulates* its two reductions (``q·k`` over ``D``, ``p·v`` over ``S``) in float32:
the float32 rounding error of a length-``n`` sum grows like ``sqrt(n) * u`` times the terms' size (the
probabilistic bound of Higham & Mary, 2019; standard-normal products reach 4-5, and the output passes
two reductions and a normalisation), hence ``C_ACC * sqrt(D + S) * u(float32)``, ``C_ACC = 16``: 7e-6 to
1.1e-5 at the short cases (the earlier flat float32 tolerance was 1e-5), 6.4e-5 at 4,096 keys. A backend that
accumulates in the reduced dtype errs by about ``sqrt(S) * u(dtype)`` relative to the output, so it
fails the long-context cases (whose values have mean 1, keeping outputs O(1)). Random inputs are
standard normal. ``OP`` below is the table at ``D = 64``, ``S = 16`` (shown in reports).

``CACHE``: model logits from prefill + cached decode vs logits from a full recomputation (a fresh
cache and a prefill of the whole sequence so far), same backend, same dtype. Logits are O(10); the
reduced-precision rows are loose because a 1-row decode matmul and an N-row prefill matmul round
differently at every layer. In reduced precision the top-1 token must also agree unless the
recomputed top-2 gap is under ``STREAM[dtype].max_gap``.

``STREAM``: greedy token streams vs the reference backend. float32 must match exactly. In reduced
precision a divergence is accepted as a near-tie (and the comparison stops there) when each stream's
token is in the other's top-``top_k`` and the logit gap between the two tokens is at most ``max_gap``
in *both* streams' logits at that step.

A lossy KV cache declares ``CacheCapabilities.unit_roundoff`` ``u``, the largest relative rounding error
of a stored element (relative to its row's largest magnitude for a per-row-scaled integer cache). Its
op tolerance widens to ``atol = rtol = max(dtype's, LOSSY_OP_FACTOR · u)``: a value row's rounding moves
an output by up to ``u · max|v|`` (about ``4u`` for unit-normal rows of 64-128 elements) and the keys'
rounding perturbs a peaked softmax over few keys by up to about as much again; the worst case measured
over the op matrix with the int8 cache is about ``9u``, and the factor 16 gives it 2x headroom (a real
addressing or scale bug errs by O(1)). Its
streams are compared tie-aware, in float32 too, with ``max_gap = max(dtype's, LOSSY_GAP_FACTOR · u)`` logits.
Its cache-tier logits get ``atol = max(dtype's, LOSSY_CACHE_FACTOR · u)``. Every such widening is one rule,
:func:`widened`: the lossless tolerance, or ``factor · u`` where that is looser.

``SPECULATIVE``: logprobs of a float32 greedy stream with speculation vs the same stream without, within
``atol = widened(SPECULATIVE_LOGPROB_ATOL, LOSSY_CACHE_FACTOR, u)`` (:func:`logprob_tolerance`). A
verification scores a request's last token and its drafts as one multi-token row, where plain decoding
scores one row per step: the same values through GEMMs of other shapes, so K/V differ by float32 rounding.
A lossless cache stores that difference as it is (logprobs agree to float32 rounding). A lossy cache rounds
both to its precision, and an element within that float32 difference of a rounding boundary of the storage
type is stored one quantum apart on the two paths; every later layer reads the stored value. That is the
cache tier's comparison (cached K/V from one GEMM shape against K/V from another), so the speculative tier
takes the cache tier's factor, applied to logprobs (the log-softmax of those logits: it moves them by at
most the spread of the logit changes, typically less).

Measured worst cases with the built-in backends are in ``docs/conformance.md`` (with the command).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "Tolerance", "TieRule", "OP", "CACHE", "STREAM", "UNIT_ROUNDOFF", "SPECULATIVE_LOGPROB_ATOL", "widened",
    "op_tolerance", "cache_tolerance", "tie_rule", "logprob_tolerance",
]


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    def __str__(self) -> str:
        return f"atol={self.atol:g} rtol={self.rtol:g}"


@dataclass(frozen=True)
class TieRule:
    """``exact``: streams must be identical. Otherwise a divergence is a near-tie when the two tokens are
    in each other's top-``top_k`` and their logit gap is ``<= max_gap`` in both streams."""

    exact: bool
    top_k: int = 5
    max_gap: float = 0.0

    def __str__(self) -> str:
        return "exact" if self.exact else f"near-tie: top-{self.top_k}, gap <= {self.max_gap:g}"


def _lookup(table: dict, dtype: torch.dtype, what: str):
    try:
        return table[dtype]
    except KeyError:
        raise KeyError(f"no {what} tolerance for {dtype}") from None


#: unit roundoff (half an ulp at 1) of each floating dtype the suite certifies
UNIT_ROUNDOFF: dict[torch.dtype, float] = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
C_IO = 6.0  # roundings of O(1) values to the model dtype a correct backend may make (scores, probabilities, output)
C_ACC = 16.0  # float32 accumulation: error ~ sqrt(n) * u(float32) per length-n reduction of terms up to ~4-5
#: (head size, keys) the ``OP`` table is printed for
OP_TABLE_SHAPE = (64, 16)


def _op_formula(dtype: torch.dtype, head_dim: int, num_keys: int) -> Tolerance:
    u = _lookup(UNIT_ROUNDOFF, dtype, "op")
    tol = C_IO * u + C_ACC * math.sqrt(head_dim + num_keys) * UNIT_ROUNDOFF[torch.float32]
    return Tolerance(atol=float(f"{tol:.3g}"), rtol=float(f"{tol:.3g}"))


OP: dict[torch.dtype, Tolerance] = {d: _op_formula(d, *OP_TABLE_SHAPE) for d in UNIT_ROUNDOFF}

CACHE: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-3, rtol=1e-4),
    torch.bfloat16: Tolerance(atol=1.0, rtol=0.05),
    torch.float16: Tolerance(atol=0.25, rtol=0.02),
}

STREAM: dict[torch.dtype, TieRule] = {
    torch.float32: TieRule(exact=True),
    torch.bfloat16: TieRule(exact=False, top_k=5, max_gap=1.0),
    torch.float16: TieRule(exact=False, top_k=5, max_gap=0.25),
}


LOSSY_OP_FACTOR = 16.0
LOSSY_GAP_FACTOR = 254.0  # int8 (u = 1/254): near-ties up to one logit


def widened(tol: float, factor: float, unit_roundoff: float = 0.0) -> float:
    """``tol`` over a lossless cache (``unit_roundoff`` 0); over a lossy one ``factor · unit_roundoff`` where
    that is looser: the one rule by which every tolerance follows a cache's declared precision."""
    return max(tol, factor * unit_roundoff) if unit_roundoff else tol


def op_tolerance(
    dtype: torch.dtype,
    unit_roundoff: float = 0.0,
    *,
    head_dim: int = OP_TABLE_SHAPE[0],
    num_keys: int = OP_TABLE_SHAPE[1],
) -> Tolerance:
    """Tolerance of an op case in ``dtype`` with head size ``head_dim`` and up to ``num_keys`` keys, over
    a cache whose stored elements carry a relative rounding error up to ``unit_roundoff`` (0: lossless)."""
    tol = _op_formula(dtype, head_dim, num_keys)
    return Tolerance(atol=widened(tol.atol, LOSSY_OP_FACTOR, unit_roundoff),
                     rtol=widened(tol.rtol, LOSSY_OP_FACTOR, unit_roundoff))


#: a lossy cache in the cache tier: the cached path's K/V (from 1-row decode GEMMs) and the recomputed
#: path's (from prefill GEMMs) differ by float rounding, and a per-token quantisation can put the two one
#: quantum apart; over a 30-layer model that moved logits (magnitude ~20) by up to ~70u (measured on
#: SmolLM2: int8 0.28, float16 storage 0.003); 128u gives ~2x headroom, and the top-1 check stays tie-aware
LOSSY_CACHE_FACTOR = 128.0


def cache_tolerance(dtype: torch.dtype, unit_roundoff: float = 0.0) -> Tolerance:
    tol = _lookup(CACHE, dtype, "cache")
    return Tolerance(atol=widened(tol.atol, LOSSY_CACHE_FACTOR, unit_roundoff), rtol=tol.rtol)


def tie_rule(dtype: torch.dtype, unit_roundoff: float = 0.0) -> TieRule:
    rule = _lookup(STREAM, dtype, "stream")
    if not unit_roundoff:
        return rule
    return TieRule(exact=False, top_k=5, max_gap=widened(rule.max_gap, LOSSY_GAP_FACTOR, unit_roundoff))


#: the speculative tier's float32 logprobs over a lossless cache: float32 rounding, with room to spare
SPECULATIVE_LOGPROB_ATOL = 1e-4


def logprob_tolerance(unit_roundoff: float = 0.0) -> float:
    """How far a float32 stream's logprobs with speculation may be from those without, over a cache whose
    stored elements carry a relative rounding error up to ``unit_roundoff`` (0: lossless)."""
    return widened(SPECULATIVE_LOGPROB_ATOL, LOSSY_CACHE_FACTOR, unit_roundoff)
