"""Weights as integer codes in groups, with a float32 scale and offset per group (``W = d q + m``): the exact form
of llama.cpp's quantized blocks, and the int8-group kernel that runs the 5-, 6- and 8-bit ones.

:class:`GroupCodes` holds a ``[N, K]`` weight as unsigned codes ``q`` and per-group ``d`` / ``m``.
:mod:`kvcore.loaders.gguf_codes` decodes GGUF blocks into it without rounding anything: every type's scale is a
float16 (times an integer sub-scale for K-quants: at most 18 significant bits, exact in float32), and signed codes
are shifted to unsigned ones with the shift folded into ``m`` (Q8_0's ``d q_s`` is ``d (q_s + 128) - 128 d``).
The weight format ``gguf`` (:mod:`kvcore.model.weights`) runs a fused matmul's codes on:

* kvcore's ``int4_linear`` kernel (:class:`~kvcore.kernels.quant.Int4A8Linear`) when every code fits in 4 bits and
  the groups are 32 columns (Q4_0, Q4_1, Q4_K), with ``d`` / ``m`` in float16 where that is exact, else float32;
* :class:`Int8GroupLinear` otherwise (Q5_0, Q5_1, Q5_K, Q8_0 in groups of 32; Q6_K in its sub-blocks of 16).

Both quantize the activations to int8 per row and group, as llama.cpp's own CPU kernels do: the weights are the
file's, the products are not float32-exact (docs/formats-and-kernels.md states the accuracy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.kernels.cpu_kernels import load_kernels
from kvcore.kernels.quant import Int4Groups

__all__ = ["GroupCodes", "Int8GroupLinear", "pack_int8_groups", "INT8_GROUP_SIZES"]

#: the group widths the int8-group kernel takes
INT8_GROUP_SIZES = (16, 32)
_ROWS = 16  # output rows per block of the kernels' layouts


@dataclass
class GroupCodes:
    """``W[n, k] = d[n, k // G] * q[n, k] + m[n, k // G]`` with ``q < 2 ** bits``."""

    q: torch.Tensor  # [N, K] uint8
    d: torch.Tensor  # [N, K // G] float32
    m: torch.Tensor  # [N, K // G] float32
    bits: int

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.d.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def regroup(self, group_size: int) -> GroupCodes:
        """The same weight in groups of ``group_size`` (a divisor of the current one: scales repeated, exact)."""
        times = self.group_size // group_size
        if times * group_size != self.group_size:
            raise ValueError(f"groups of {self.group_size} cannot be split into groups of {group_size}")
        d, m = (t.repeat_interleave(times, dim=1) for t in (self.d, self.m))
        return GroupCodes(self.q, d, m, self.bits)

    @staticmethod
    def cat(parts: list[GroupCodes]) -> GroupCodes:
        """Rows of ``parts`` stacked (a fused Q/K/V or gate/up matmul), in the smallest group size among them."""
        size = min(p.group_size for p in parts)
        parts = [p.regroup(size) for p in parts]
        return GroupCodes(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "d", "m")),
                          max(p.bits for p in parts))

    @property
    def d_and_m(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(d, m)`` of ``W = d q + m`` (what :func:`~kvcore.kernels.quant.pack_int4a8` reads)."""
        return self.d, self.m

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` float32: ``d q`` is exact for GGUF blocks, so this rounds once, as llama.cpp's reference does."""
        n, k = self.shape
        q = self.q.float().view(n, -1, self.group_size)
        return (q * self.d[..., None] + self.m[..., None]).view(n, k)

    def int4_groups(self) -> Int4Groups:
        """4-bit codes in the torch int4 kernel's convention ``(q - 8) s + z`` (``s = d``, ``z = m + 8 d``)."""
        if self.bits > 4:
            raise ValueError(f"{self.bits}-bit codes have no int4 form")
        return Int4Groups(self.q, self.d, self.m + 8 * self.d)


def pack_int8_groups(codes: GroupCodes) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed [N / 16, K / G, 16 G] uint8, dm [N / 16, K / G, 2, 16] float32)`` in the int8-group kernel's
    layout: per block of 16 output rows and group, byte ``64 j + 4 row + i`` holds code ``4 j + i`` of that row
    (each 32-bit lane one row's four consecutive codes, vpdpbusd's operand shape); then the 16 rows' ``d`` and ``m``."""
    n, k = codes.shape
    g = codes.group_size
    q = codes.q.view(n // _ROWS, _ROWS, k // g, g // 4, 4)  # block, row, group, j, i
    packed = q.permute(0, 2, 3, 1, 4).reshape(n // _ROWS, k // g, _ROWS * g).contiguous()
    dm = torch.stack([t.view(n // _ROWS, _ROWS, -1).permute(0, 2, 1) for t in (codes.d, codes.m)], dim=2)
    return packed, dm.float().contiguous()


class Int8GroupLinear:
    """``y = x @ W.T`` with ``W`` in :class:`GroupCodes` form on ``torch.ops.kvcore.int8_group_linear``
    (``csrc/int8_group_linear.cpp``): one byte per code, ``d`` and ``m`` in float32 per group of 16 or 32."""

    format = "gguf"

    def __init__(self, codes: GroupCodes, dtype: torch.dtype = torch.bfloat16) -> None:
        n, k = codes.shape
        if not self.fits(n, k, codes.group_size):
            raise ValueError(f"int8-group kernel cannot take a [{n}, {k}] weight in groups of {codes.group_size}")
        load_kernels()
        self.shape, self.group_size, self.dtype = (n, k), codes.group_size, dtype
        self.packed, self.dm = pack_int8_groups(codes)

    @staticmethod
    def fits(n: int, k: int, group_size: int) -> bool:
        """The kernel's shape rules: output rows in multiples of 16, whole groups of 16 or 32 columns."""
        return n % _ROWS == 0 and group_size in INT8_GROUP_SIZES and k % group_size == 0

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.dm.nbytes

    def relocate(self, take) -> None:
        """Hold the codes and scales where ``take`` copies them (:func:`~kvcore.kernels.huge_pages.move_into_huge_pages`
        calls it)."""
        self.packed = take(self.packed)
        self.dm = take(self.dm)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, K]`` in ``self.dtype`` -> ``[T, N]``."""
        return torch.ops.kvcore.int8_group_linear(x.contiguous(), self.packed, self.dm)
