"""GGUF weights kept as their quantized blocks, for the int4 weight format (:mod:`kvcore.kernels.quant`).

llama.cpp's Q4_0 and Q4_1 store each row in blocks of 32 weights: a float16 scale ``d`` (and Q4_1 a float16
minimum ``m``) and 32 4-bit codes ``q`` (the low nibbles of 16 bytes are weights 0..15, the high nibbles
16..31). Both are exactly the int4 kernel's ``(q - 8) * s + z`` with groups of 32:

* Q4_0: ``W = d * (q - 8)``  ->  ``s = d, z = 0``;
* Q4_1: ``W = d * q + m``    ->  ``s = d, z = m + 8 d`` (``8 d`` and the float16 ``m`` sum exactly in float32).

Other types (Q8_0, K-quants, Q5_*) have no exact int4 form: they are dequantized (:meth:`GGUFBlocks.dequantize`).
Row operations (splitting fused tensors, llama's Q/K row unpermute) act on whole rows of blocks, so they
commute with the packing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from kvcore.kernels.quant import Int4Groups

__all__ = ["GGUFBlocks", "INT4_TYPES"]

#: the GGUF types that map onto the int4 kernel exactly
INT4_TYPES = (QType.Q4_0, QType.Q4_1)


class GGUFBlocks:
    """A 2-D GGUF tensor as stored: ``data`` ``[rows, bytes per row]`` uint8 of ``qtype`` blocks; ``shape`` is the
    logical ``[rows, columns]`` (Hugging Face's ``[out, in]``)."""

    def __init__(self, qtype: QType, data: np.ndarray, shape: tuple[int, int]) -> None:
        self.qtype, self.shape = qtype, (int(shape[0]), int(shape[1]))
        self.data = np.asarray(data, dtype=np.uint8).reshape(self.shape[0], -1)

    def __repr__(self) -> str:
        return f"GGUFBlocks({self.qtype.name}, shape={list(self.shape)})"

    @property
    def int4_exact(self) -> bool:
        return self.qtype in INT4_TYPES

    def split(self, sizes: Sequence[int], dim: int = 0) -> list[GGUFBlocks]:
        """Row ranges of ``sizes`` (like ``Tensor.split(sizes, 0)``: a fused tensor cut into its parts)."""
        if dim != 0:
            raise ValueError("GGUF blocks split along rows only")
        bounds = np.cumsum([0, *sizes])
        return [GGUFBlocks(self.qtype, self.data[a:b], (b - a, self.shape[1])) for a, b in zip(bounds, bounds[1:])]

    def map_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> GGUFBlocks:
        """A copy with rows reordered by ``fn`` (any ``[rows, ...] -> [rows, ...]`` row permutation)."""
        return GGUFBlocks(self.qtype, np.ascontiguousarray(fn(self.data)), self.shape)

    def dequantize(self) -> torch.Tensor:
        """``[rows, columns]`` float32, as llama.cpp's reference dequantization (the ``gguf`` package) gives."""
        values = gguf.quants.dequantize(self.data, self.qtype)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(self.shape))

    def is_finite(self) -> bool:
        """Whether every block's float16 scale (and Q4_1 minimum) is finite: the 4-bit codes cannot be anything
        else, so this is the whole of a NaN / infinity check."""
        if not self.int4_exact:
            return bool(torch.isfinite(self.dequantize().sum()))
        type_size = gguf.GGML_QUANT_SIZES[self.qtype][1]
        halves = 2 if self.qtype == QType.Q4_1 else 1
        blocks = self.data.reshape(-1, type_size)[:, : 2 * halves]
        return bool(np.isfinite(blocks.copy().view(np.float16)).all())

    def int4_groups(self) -> Int4Groups:
        """Q4_0 / Q4_1 rows as int4 codes, scales and offsets in groups of 32 (exact, see the module doc)."""
        if not self.int4_exact:
            raise ValueError(f"{self.qtype.name} blocks have no exact int4 form")
        rows, cols = self.shape
        block_size, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        blocks = self.data.reshape(rows, cols // block_size, type_size)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, blocks]
        if self.qtype == QType.Q4_1:
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            zeros = m + 8 * d
        else:
            zeros = np.zeros_like(d)
        qs = blocks[..., type_size - block_size // 2:]  # [rows, blocks, 16]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
        return Int4Groups(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zeros))
