"""GGUF weights kept as their quantized blocks, for the quantized weight formats (:mod:`kvcore.kernels.quant`,
:mod:`kvcore.kernels.group_quant`).

The block types of :data:`~kvcore.loaders.gguf_codes.CODE_TYPES` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
decode exactly into integer codes with a float32 scale and offset per group (:meth:`GGUFBlocks.codes`,
:mod:`kvcore.loaders.gguf_codes`): the ``gguf`` weight format runs them as stored, and the 4-bit ones are the int4
formats' groups of 32 (Q4_0: ``s = d, z = 0``; Q4_1: ``s = d, z = m + 8 d``; Q4_K: ``s = d sc, z = -dmin mn + 8 d sc``).
Other types (Q2_K, Q3_K) are dequantized (:meth:`GGUFBlocks.dequantize`). Row operations (splitting fused tensors,
llama's Q/K row unpermute) act on whole rows of blocks, so they commute with the packing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from kvcore.kernels.cpu_kernels import kernels_loaded
from kvcore.kernels.group_quant import GroupCodes
from kvcore.kernels.quant import Int4Groups
from kvcore.loaders.file_rows import FileRange, FileRows
from kvcore.loaders.gguf_codes import CODE_BITS, CODE_TYPES, SCALE_OFFSETS, group_codes, int4a8_layout
from kvcore.loaders.watched import WatchedFile

__all__ = ["GGUFBlocks", "INT4_TYPES", "CODE_TYPES", "file_blocks"]

#: the GGUF types whose files the ``auto`` weight format runs as ``int4a8`` (llama.cpp's legacy 4-bit blocks)
INT4_TYPES = (QType.Q4_0, QType.Q4_1)
#: rows dequantized per ``gguf`` call (it makes several temporaries the size of its input)
_DEQUANT_ROWS = 1024
#: blocks read at a time by a pass over a tensor in the file (:meth:`GGUFBlocks.is_finite`)
_SCAN_BLOCKS = 1 << 18
#: bytes of a Q8_0 block: a float16 scale and 32 signed codes
_Q8_0_BYTES = 34


def file_blocks(path: str | os.PathLike[str], offset: int, nbytes: int) -> FileRange:
    """A reader of ``nbytes`` bytes at ``offset`` of ``path``: each call reads them into a new array (no mapping
    of the file stays behind, so its pages are the page cache's, not this process's)."""
    return FileRange(path, offset, nbytes)


class GGUFBlocks:
    """A 2-D GGUF tensor as stored: ``data`` ``[rows, bytes per row]`` uint8 of ``qtype`` blocks; ``shape`` is the
    logical ``[rows, columns]`` (Hugging Face's ``[out, in]``).

    ``data`` may be given as an array or as a function reading it (:func:`file_blocks`): the loader hands out
    tensors that read their bytes from the file each time they are consumed, so a model is built one tensor at a
    time and neither the file's pages nor a float copy of it pile up in memory."""

    def __init__(self, qtype: QType, data: np.ndarray | Callable[[], np.ndarray], shape: tuple[int, int]) -> None:
        self.qtype, self.shape = qtype, (int(shape[0]), int(shape[1]))
        self._table: torch.Tensor | FileRows | None = None  # set by resident() and lookup_table()
        self._file = data if isinstance(data, FileRange) else None  # the blocks are this range of a file as stored
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

    @property
    def has_codes(self) -> bool:
        """Whether :meth:`codes` decodes this type exactly (else only :meth:`dequantize` reads it)."""
        return self.qtype in CODE_TYPES

    @property
    def code_bits(self) -> int | None:
        """The width of this type's codes (4 for Q4_*, 5, 6, 8), None where it has no :meth:`codes`."""
        return CODE_BITS.get(self.qtype)

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

    def resident(self) -> GGUFBlocks:
        """These blocks read once and held (a table the model keeps as stored, decoding rows per lookup)."""
        held = GGUFBlocks(self.qtype, self.data, self.shape)
        held._table = torch.from_numpy(held.data)  # the same bytes as a tensor, indexed per lookup
        return held

    def lookup_table(self) -> GGUFBlocks:
        """These blocks as a table that decodes rows per lookup: read from the file row by row where they are a
        range of one as stored (:class:`~kvcore.loaders.file_rows.FileRows`: the process holds no copy), else
        :meth:`resident`."""
        if self._file is None:
            return self.resident()
        table = GGUFBlocks(self.qtype, self._file, self.shape)
        table._table = self._file.rows(self.shape[0])
        return table

    @property
    def file_range(self) -> FileRange | None:
        """The range of the model file these blocks are as stored, or None (blocks held or rearranged)."""
        return self._file

    @property
    def source_file(self) -> WatchedFile | None:
        """The open file a lookup reads its rows from (:attr:`in_file`), or None."""
        return self._table.file if isinstance(self._table, FileRows) else None

    @property
    def in_file(self) -> bool:
        """Whether the rows a lookup decodes are read from the file (:meth:`lookup_table`), not held in memory."""
        return isinstance(self._table, FileRows)

    @property
    def nbytes(self) -> int:
        """The blocks' bytes (as stored; in memory unless :attr:`in_file`)."""
        return self._file.nbytes if self._file is not None else self.data.nbytes

    def rows(self, index: torch.Tensor | slice, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``index`` (``[n]`` int64 or a slice) ``[n, columns]`` in ``dtype``: exactly the rows of
        :meth:`dequantize` (llama.cpp's reference values in float32, rounded once), only those decoded."""
        table = self._table if self._table is not None else torch.from_numpy(self.data)
        q8_0_native = self.qtype == QType.Q8_0 and kernels_loaded()  # the token tables of llama.cpp's files
        if q8_0_native and isinstance(table, FileRows) and isinstance(index, torch.Tensor):
            rows = torch.ops.kvcore.q8_0_kept_rows(*table.kept, index, self.shape[1], dtype)
            if rows.shape[0] == index.numel():  # every row was kept: gathered and decoded in one call
                return rows
        picked = table[index]  # [n, bytes per row]
        if q8_0_native:  # one call
            return torch.ops.kvcore.q8_0_rows(picked.contiguous(), self.shape[1], dtype)
        if self.qtype == QType.Q8_0:  # the same values from torch's ops, where kvcore's kernels are not loaded
            blocks = picked.reshape(-1, _Q8_0_BYTES)
            d = blocks[:, :2].contiguous().view(torch.float16).float()
            q = blocks[:, 2:].contiguous().view(torch.int8).float()
            return (q * d).view(-1, self.shape[1]).to(dtype)  # d q is exact in float32, as the reference's
        rows = gguf.quants.dequantize(picked.numpy(), self.qtype).reshape(-1, self.shape[1])
        return torch.from_numpy(rows).to(dtype)

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
        """Whether every value is finite: for coded types, whether every block's float16 scales are (the codes and
        the K-quants' integer sub-scales cannot be anything else), read without decoding."""
        if not self.has_codes:
            data = self.data
            return all(np.isfinite(gguf.quants.dequantize(data[a : a + _DEQUANT_ROWS], self.qtype).sum())
                       for a in range(0, self.shape[0], _DEQUANT_ROWS))
        size = gguf.GGML_QUANT_SIZES[self.qtype][1]
        # blocks as stored are read a piece at a time: this pass keeps nothing
        pieces = self._file.pieces(_SCAN_BLOCKS * size) if self._file is not None else (self.data,)
        for piece in pieces:
            blocks = piece.reshape(-1, size)
            # a little-endian float16 is inf or NaN when its high byte holds the five exponent bits all set
            if any(((blocks[:, at + 1] & 0x7C) == 0x7C).any() for at in SCALE_OFFSETS[self.qtype]):
                return False
        return True

    def codes(self) -> GroupCodes:
        """The rows as :class:`GroupCodes` (exact: see :mod:`kvcore.loaders.gguf_codes`)."""
        if not self.has_codes:
            raise ValueError(f"{self.qtype.name} blocks have no exact code form")
        return group_codes(self.qtype, self.data, self.shape, gguf.GGML_QUANT_SIZES[self.qtype][1])

    def int4a8_layout(
        self, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """These rows in the int4a8 kernel's layout without decoding them (Q4_0 / Q4_1;
        :func:`~kvcore.loaders.gguf_codes.int4a8_layout`, written into ``out`` when given), else None."""
        return int4a8_layout(self.qtype, self.data, self.shape, out)

    def int4_groups(self) -> Int4Groups:
        """4-bit rows (Q4_0, Q4_1, Q4_K) as int4 codes, scales and offsets in groups of 32."""
        if self.code_bits != 4:
            raise ValueError(f"{self.qtype.name} blocks have no int4 form")
        return self.codes().int4_groups()
