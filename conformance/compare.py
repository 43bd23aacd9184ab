"""Tensor comparison with a diagnosis: how far off, where, and how much of it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.conformance.tolerances import Tolerance

__all__ = ["Mismatch", "compare"]


@dataclass
class Mismatch:
    max_err: float  # max |out - ref| (inf when ``out`` has NaN/inf where ``ref`` is finite)
    num_bad: int  # elements outside the tolerance
    numel: int
    worst_index: tuple[int, ...]  # index of the worst out-of-tolerance element
    out_value: float
    ref_value: float
    #: the first out-of-tolerance element in memory order (the earliest packed row: where a bug starts acting)
    first_index: tuple[int, ...] = ()
    first_out: float = 0.0
    first_ref: float = 0.0

    @property
    def ok(self) -> bool:
        return self.num_bad == 0


def compare(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> Mismatch:
    """Compare ``out`` (any dtype) with the float32 ``ref`` of the same shape under ``tol``."""
    out32 = out.detach().float().cpu()
    ref32 = ref.detach().float().cpu()
    diff = (out32 - ref32).abs().nan_to_num(nan=float("inf"))
    bad = ~torch.isclose(out32, ref32, rtol=tol.rtol, atol=tol.atol)
    num_bad = int(bad.sum())
    max_err = float(diff.max()) if diff.numel() else 0.0
    if num_bad:
        flat = torch.where(bad.flatten(), diff.flatten(), torch.full_like(diff.flatten(), -1.0)).argmax()
    else:
        flat = diff.flatten().argmax() if diff.numel() else torch.tensor(0)
    index = _unravel(int(flat), tuple(diff.shape)) if diff.numel() else ()
    first = _unravel(int(bad.flatten().nonzero()[0]), tuple(diff.shape)) if num_bad else ()
    return Mismatch(
        max_err=max_err,
        num_bad=num_bad,
        numel=diff.numel(),
        worst_index=index,
        out_value=float(out32[index]) if diff.numel() else 0.0,
        ref_value=float(ref32[index]) if diff.numel() else 0.0,
        first_index=first,
        first_out=float(out32[first]) if first else 0.0,
        first_ref=float(ref32[first]) if first else 0.0,
    )


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))
