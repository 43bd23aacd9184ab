"""Byte ranges of a model file read on demand: whole (a tensor consumed once, as a model is built) or row by row
(a quantized token table that the model keeps in the file and reads a few rows of per step).

:class:`FileRows` reads each row it is asked for with ``pread`` from a descriptor it holds open. The process keeps no
copy of the table: the rows it reads come from the kernel's page cache of the file, which is not this process's
memory. A memory map would not do the same: a fault maps the whole page-cache folio around the touched row
(up to a MiB on recent kernels), and the int4 head's rescored candidates are spread over the whole vocabulary, so
within a few steps the whole table would count in the process's resident memory again.

The file must stay as it was while it is in use: replaced by a new file (``mv``, an editor's save, a package
upgrade) the open descriptor keeps reading the old one; written over in place or truncated, the next read says
so (:class:`~kvcore.errors.ModelLoadError`) instead of returning other bytes.
"""

from __future__ import annotations

import os
import weakref

import numpy as np
import torch

from kvcore.errors import ModelLoadError

__all__ = ["FileRange", "FileRows"]


class FileRange:
    """``nbytes`` bytes at ``offset`` of ``path``. Calling it reads them into a new array (no mapping of the file
    stays behind, so its pages are the page cache's, not this process's); :meth:`rows` reads them by rows."""

    def __init__(self, path: str | os.PathLike[str], offset: int, nbytes: int) -> None:
        self.path, self.offset, self.nbytes = os.fspath(path), int(offset), int(nbytes)

    def __call__(self) -> np.ndarray:
        out = np.empty(self.nbytes, dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.offset)
            view, done = memoryview(out), 0
            while done < self.nbytes:
                n = f.readinto(view[done:])
                if not n:
                    raise OSError(f"'{self.path}' ended inside a tensor (truncated?)")
                done += n
        return out

    def rows(self, num_rows: int) -> FileRows:
        """This range as ``num_rows`` equal rows, read per lookup."""
        return FileRows(self, num_rows)


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns


class FileRows:
    """``[rows, row_bytes]`` uint8 rows of a :class:`FileRange`, read when indexed (``rows[index]``)."""

    def __init__(self, source: FileRange, num_rows: int) -> None:
        if num_rows <= 0 or source.nbytes % num_rows:
            raise ValueError(f"{source.nbytes} bytes are not {num_rows} equal rows")
        self.path, self.offset = source.path, source.offset
        self.shape = (num_rows, source.nbytes // num_rows)
        try:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise ModelLoadError(f"cannot read '{self.path}': {exc.strerror or exc}") from None
        self._identity = _identity(os.fstat(self._fd))
        weakref.finalize(self, os.close, self._fd)

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
        ids = index.reshape(-1).tolist()
        if ids and (min(ids) < 0 or max(ids) >= rows):
            raise IndexError(f"row index out of range for a table of {rows} rows")
        out = np.empty((len(ids), width), dtype=np.uint8)
        self._check()
        for row, i in zip(out, ids):
            self._read(row, i, checked=True)
        return torch.from_numpy(out).view(*index.shape, width)

    def _read(self, out: np.ndarray, row: int, checked: bool = False) -> None:
        if not checked:
            self._check()
        if os.preadv(self._fd, [out], self.offset + row * self.shape[1]) != out.nbytes:
            raise ModelLoadError(f"'{self.path}' ended inside the tensor kvcore reads from it: it was truncated "
                                 "while in use")

    def _check(self) -> None:
        if _identity(os.fstat(self._fd)) != self._identity:
            raise ModelLoadError(f"'{self.path}' was written to while in use (kvcore reads its token table from "
                                 "the file): restart with the file unchanged")
