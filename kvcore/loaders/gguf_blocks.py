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

import os
from collections.abc import Callable, Sequence

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from kvcore.kernels.quant import Int4Groups

__all__ = ["GGUFBlocks", "INT4_TYPES", "file_blocks"]

#: the GGUF types that map onto the int4 kernel exactly
INT4_TYPES = (QType.Q4_0, QType.Q4_1)
#: rows dequantized per ``gguf`` call (it makes several temporaries the size of its input)
_DEQUANT_ROWS = 1024


def file_blocks(path: str | os.PathLike[str], offset: int, nbytes: int) -> Callable[[], np.ndarray]:
    """A reader of ``nbytes`` bytes at ``offset`` of ``path``: each call reads them into a new array (no mapping
    of the file stays behind, so its pages are the page cache's, not this process's)."""

    def read() -> np.ndarray:
        out = np.empty(nbytes, dtype=np.uint8)
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            view, done = memoryview(out), 0
            while done < nbytes:
                n = f.readinto(view[done:])
                if not n:
                    raise OSError(f"'{path}' ended inside a tensor (truncated?)")
                done += n
        return out

    return read


class GGUFBlocks:
    """A 2-D GGUF tensor as stored: ``data`` ``[rows, bytes per row]`` uint8 of ``qtype`` blocks; ``shape`` is the
    logical ``[rows, columns]`` (Hugging Face's ``[out, in]``).

    ``data`` may be given as an array or as a function reading it (:func:`file_blocks`): the loader hands out
    tensors that read their bytes from the file each time they are consumed, so a model is built one tensor at a
    time and neither the file's pages nor a float copy of it pile up in memory."""

    def __init__(self, qtype: QType, data: np.ndarray | Callable[[], np.ndarray], shape: tuple[int, int]) -> None:
        self.qtype, self.shape = qtype, (int(shape[0]), int(shape[1]))
        if callable(data):
            self._read = data
        else:
            array = np.asarray(data, dtype=np.uint8).reshape(self.shape[0], -1)
            self._read = lambda: array

    def __repr__(self) -> str:
        return f"GGUFBlocks({self.qtype.name}, shape={list(self.shape)})"

    @property
    def data(self) -> np.ndarray:
        """``[rows, bytes per row]`` uint8 (read now when the tensor was given as a reader)."""
        return np.asarray(self._read(), dtype=np.uint8).reshape(self.shape[0], -1)

    @property
    def int4_exact(self) -> bool:
        return self.qtype in INT4_TYPES

    def split(self, sizes: Sequence[int], dim: int = 0) -> list[GGUFBlocks]:
        """Row ranges of ``sizes`` (like ``Tensor.split(sizes, 0)``: a fused tensor cut into its parts)."""
        if dim != 0:
            raise ValueError("GGUF blocks split along rows only")
        bounds = [int(b) for b in np.cumsum([0, *sizes])]
        return [GGUFBlocks(self.qtype, lambda a=a, b=b: self.data[a:b], (b - a, self.shape[1]))
                for a, b in zip(bounds, bounds[1:])]

    def map_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> GGUFBlocks:
        """These rows reordered by ``fn`` (any ``[rows, ...] -> [rows, ...]`` row permutation), applied on each read."""
        return GGUFBlocks(self.qtype, lambda: np.ascontiguousarray(fn(self.data)), self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[rows, columns]`` in ``dtype``: llama.cpp's reference dequantization (the ``gguf`` package) in float32,
        rounded once to ``dtype``."""
        out = torch.empty(self.shape, dtype=dtype)
        self.dequantize_into(out)
        return out

    def dequantize_into(self, out: torch.Tensor) -> None:
        """Write the dequantized values into ``out`` (``[rows, columns]``, any float dtype and layout), a chunk of
        rows at a time: the float32 values of a whole table (and the ``gguf`` package's temporaries, several
        times its size) never exist at once."""
        data = self.data
        for start in range(0, self.shape[0], _DEQUANT_ROWS):
            rows = gguf.quants.dequantize(data[start : start + _DEQUANT_ROWS], self.qtype)
            out[start : start + _DEQUANT_ROWS].copy_(torch.from_numpy(rows.reshape(-1, self.shape[1])))

    def is_finite(self) -> bool:
        """Whether every block's float16 scale (and Q4_1 minimum) is finite: the 4-bit codes cannot be anything
        else, so this is the whole of a NaN / infinity check."""
        if not self.int4_exact:
            data = self.data
            return all(np.isfinite(gguf.quants.dequantize(data[a : a + _DEQUANT_ROWS], self.qtype).sum())
                       for a in range(0, self.shape[0], _DEQUANT_ROWS))
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
