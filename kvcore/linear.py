"""Fast CPU matmuls for the decoder's weights: layout choice, oneDNN prepacking, split single-row GEMVs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["COLUMN_MAJOR_MIN_NUMEL", "prepack", "row_bucket", "weight_version", "linear", "set_layout"]

#: weights smaller than this (elements; 512 KiB in float32, about a core's L2) keep row-major: cache-resident
#: GEMVs gain nothing from column-major, and small test models keep their exact historical numerics
COLUMN_MAJOR_MIN_NUMEL = 1 << 17


def prepack(p: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a big ``[out, in]`` float32 weight (None for small ones: plain F.linear)."""
    if p.numel() < COLUMN_MAJOR_MIN_NUMEL or not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(p.detach().contiguous(), 8)  # blocked for ~8-row inputs


def row_bucket(rows: int) -> int:
    """The row count a prepacked GEMM of ``rows`` rows runs at: a power of two up to 16, then the next
    multiple of 1/8 of the power of two below (at most 12.5% padding). oneDNN keeps state per input
    shape for as long as the process lives, so exact row counts (every prompt length a server sees)
    made memory grow without bound; these buckets cap it at 8 shapes per octave."""
    if rows <= 16:
        return 1 << max(rows - 1, 0).bit_length()
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def weight_version(p: torch.Tensor) -> int:
    """In-place update counter (inference-mode tensors have none: their packed copy is keyed on storage only)."""
    try:
        return p._version
    except RuntimeError:
        return -1


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, parts: int = 1) -> torch.Tensor:
    """``F.linear(x, weight)``, via oneDNN when ``weight`` has a prepacked copy, or, for one row and a big
    column-major weight, as ``parts`` partial GEMVs over slices of the input dimension in one ``bmm``
    (ATen runs the batch in parallel: one thread per slice; MKL's single GEMV leaves half the memory
    bandwidth of a 2-core machine unused), summed."""
    if packed is not None:
        rows = x.shape[0]
        padded = row_bucket(rows)
        if padded != rows:
            x = F.pad(x, (0, 0, 0, padded - rows))
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")[:rows]
    if parts > 1 and weight.stride(0) == 1 and weight.numel() >= COLUMN_MAJOR_MIN_NUMEL:
        n, k = weight.shape
        if k % parts == 0:
            partial = torch.bmm(x.reshape(parts, 1, k // parts), weight.t().view(parts, k // parts, n))  # [P, 1, N]
            return partial.sum(0)
    return F.linear(x, weight)


def set_layout(p: nn.Parameter, column_major: bool) -> None:
    column_major = column_major and p.numel() >= COLUMN_MAJOR_MIN_NUMEL
    is_column_major = p.dim() == 2 and p.stride() == (1, p.shape[0])
    if column_major and not is_column_major:
        p.data = p.data.t().contiguous().t()
    elif not column_major and not p.is_contiguous():
        p.data = p.data.contiguous()
