"""Per-dtype tolerances of every comparison the suite makes. This table is the documented contract.

``OP``: attention output of the backend under test vs the float32 reference (``naive`` over a
``ContiguousKVCache``, fed the *same* rounded q/k/v upcast to float32). An element passes when
``|out - ref| <= atol + rtol * |ref|`` (``torch.isclose``). Random inputs are standard normal, so
outputs are O(1).

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

Measured on CPU (torch 2.13, 2 cores) with the built-in backends, worst case over the full case
matrix: op fp32 max error ~1e-6; cache fp32 ~2e-5 (SmolLM2, 30 layers), bf16 ~0.3. See
``docs/conformance.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Tolerance", "TieRule", "OP", "CACHE", "STREAM", "op_tolerance", "cache_tolerance", "tie_rule"]


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


OP: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2),
    torch.float16: Tolerance(atol=3e-3, rtol=3e-3),
}

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


def _lookup(table: dict, dtype: torch.dtype, what: str):
    try:
        return table[dtype]
    except KeyError:
        raise KeyError(f"no {what} tolerance for {dtype}") from None


LOSSY_OP_FACTOR = 16.0
LOSSY_GAP_FACTOR = 254.0  # int8 (u = 1/254): near-ties up to one logit


def op_tolerance(dtype: torch.dtype, unit_roundoff: float = 0.0) -> Tolerance:
    tol = _lookup(OP, dtype, "op")
    if not unit_roundoff:
        return tol
    widened = LOSSY_OP_FACTOR * unit_roundoff
    return Tolerance(atol=max(tol.atol, widened), rtol=max(tol.rtol, widened))


def cache_tolerance(dtype: torch.dtype) -> Tolerance:
    return _lookup(CACHE, dtype, "cache")


def tie_rule(dtype: torch.dtype, unit_roundoff: float = 0.0) -> TieRule:
    rule = _lookup(STREAM, dtype, "stream")
    if not unit_roundoff:
        return rule
    return TieRule(exact=False, top_k=5, max_gap=max(rule.max_gap, LOSSY_GAP_FACTOR * unit_roundoff))
