"""Byte ranges of a model file read on demand: whole (a tensor consumed once, as a model is built) or row by row
(a quantized token table that the model keeps in the file and reads a few rows of per step).

:class:`FileRows` reads each row it is asked for with ``pread`` from a descriptor it holds open. The process keeps no
copy of the table: the rows it reads come from the kernel's page cache of the file, which is not this process's
memory. A memory map would not do the same: a fault maps the whole page-cache folio around the touched row
(up to a MiB on recent kernels), and the int4 head's rescored candidates are spread over the whole vocabulary, so
within a few steps the whole table would count in the process's resident memory again.

Rows once read are kept (up to :data:`CACHE_ROWS` of them; the cache starts over when full): a step's rescored
candidates are mostly rows earlier steps read too, so most lookups make no system call.

The file must stay as it was while it is in use: replaced by a new file (``mv``, an editor's save, a package
upgrade) the open descriptor keeps reading the old one; written over in place or truncated, the next read says
so (:class:`~kvcore.errors.ModelFileChangedError`) instead of returning other bytes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import torch

from kvcore.errors import ModelFileChangedError
from kvcore.loaders.watched import WatchedFile

__all__ = ["CACHE_ROWS", "FileRange", "FileRows"]

#: rows a :class:`FileRows` keeps after reading them (a few MiB for a small model's table)
CACHE_ROWS = 4096


class FileRange:
    """``nbytes`` bytes at ``offset`` of ``path``. Calling it reads them into a new array (no mapping of the file
    stays behind, so its pages are the page cache's, not this process's); :meth:`rows` reads them by rows."""

    def __init__(self, path: str | os.PathLike[str], offset: int, nbytes: int) -> None:
        self.path, self.offset, self.nbytes = os.fspath(path), int(offset), int(nbytes)

    def __call__(self) -> np.ndarray:
        out = np.empty(self.nbytes, dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.offset)
            self._fill(f, out)
        return out

    def pieces(self, size: int) -> Iterator[np.ndarray]:
        """The bytes in order, ``size`` at a time (the last piece may be shorter), each read into the same buffer:
        a view valid until the next piece is read. A pass that only looks at the bytes needs no memory the size of
        the range (nor the page faults of filling it)."""
        buffer = np.empty(min(size, self.nbytes), dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.offset)
            for start in range(0, self.nbytes, size):
                piece = buffer[: min(size, self.nbytes - start)]
                self._fill(f, piece)
                yield piece

    def _fill(self, f, out: np.ndarray) -> None:
        view, done = memoryview(out), 0
        while done < out.nbytes:
            n = f.readinto(view[done:])
            if not n:
                raise OSError(f"'{self.path}' ended inside a tensor (truncated?)")
            done += n

    def rows(self, num_rows: int, cache_rows: int = CACHE_ROWS) -> FileRows:
        """This range as ``num_rows`` equal rows, read per lookup (keeping up to ``cache_rows`` of them)."""
        return FileRows(self, num_rows, cache_rows)


class FileRows:
    """``[rows, row_bytes]`` uint8 rows of a :class:`FileRange`, read when indexed (``rows[index]``). Lookups of up
    to half of ``cache_rows`` rows go through the cache; longer ones (a long prompt's embedding) and slices (a pass
    over the table) read their rows directly. One engine's steps use it: it is not for concurrent threads."""

    def __init__(self, source: FileRange, num_rows: int, cache_rows: int = CACHE_ROWS) -> None:
        if num_rows <= 0 or source.nbytes % num_rows:
            raise ValueError(f"{source.nbytes} bytes are not {num_rows} equal rows")
        self.path, self.offset = source.path, source.offset
        self.shape = (num_rows, source.nbytes // num_rows)
        #: the file, held open: read from, and watched for changes (by each read and by the engine's health check)
        self.file = WatchedFile(self.path)
        self._cache = np.empty((min(cache_rows, num_rows), self.shape[1]), dtype=np.uint8)  # resident as filled
        self._slot_of = np.full(num_rows, -1, dtype=np.int32)  # row -> its place in _cache, -1: not kept
        self._row_of = np.empty(len(self._cache), dtype=np.int64)  # place -> row
        self._used = 0
        #: ``(kept rows [C, row_bytes] uint8, each row's place in them [rows] int32, -1: not kept)``: tensors sharing
        #: the cache's memory, for a native lookup of kept rows (``torch.ops.kvcore.q8_0_kept_rows``)
        self.kept = (torch.from_numpy(self._cache), torch.from_numpy(self._slot_of))

    def __getitem__(self, index: torch.Tensor | slice) -> torch.Tensor:
        """Rows ``index`` (int64 of any shape, each in ``[0, rows)``, or a slice): ``[*index.shape, row_bytes]``."""
        rows, width = self.shape
        if isinstance(index, slice):
            start, stop, step = index.indices(rows)
            if step == 1:  # contiguous rows: one read
                out = np.empty((max(stop - start, 0), width), dtype=np.uint8)
                self._read(out.reshape(-1), start)
                return torch.from_numpy(out)
            index = torch.arange(start, stop, step)
        ids = index.reshape(-1).numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= rows):
            raise IndexError(f"row index out of range for a table of {rows} rows")
        if 2 * ids.size > len(self._cache):
            out = np.empty((ids.size, width), dtype=np.uint8)
            self._check()
            for row, i in zip(out, ids.tolist()):
                self._read(row, i, checked=True)
        else:
            slots = self._slot_of[ids]
            if (slots < 0).any():
                self._keep(ids, ids[slots < 0])
                slots = self._slot_of[ids]
            out = self._cache[slots]
        return torch.from_numpy(out).view(*index.shape, width)

    def _keep(self, ids: np.ndarray, missing: np.ndarray) -> None:
        """Read the ``missing`` rows of a lookup of ``ids`` into the cache, first emptying it where they do not fit
        (then every row of the lookup is read again: none is overwritten before it is copied out)."""
        if self._used + missing.size > len(self._cache):
            self._slot_of[self._row_of[: self._used]] = -1
            self._used, missing = 0, ids
        self._check()
        for i in np.unique(missing).tolist():  # in file order, each once
            self._read(self._cache[self._used], i, checked=True)
            self._slot_of[i], self._row_of[self._used] = self._used, i
            self._used += 1

    def _read(self, out: np.ndarray, row: int, checked: bool = False) -> None:
        if not checked:
            self._check()
        if os.preadv(self.file.fd, [out], self.offset + row * self.shape[1]) != out.nbytes:
            raise ModelFileChangedError(f"model file '{self.path}' ended inside the tensor kvcore reads from it: it "
                                        "was truncated while in use")

    def _check(self) -> None:
        self.file.check()
