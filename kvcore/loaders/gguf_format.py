"""GGUF's table structures and a bounds-checked read cursor over a file's bytes (see
:mod:`kvcore.loaders.gguf_validate`)."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from kvcore.errors import ModelLoadError

__all__ = ["GGUFFormatError", "GGUFTensorInfo", "GGUFLayout", "Cursor", "MAX_STRING_BYTES"]

#: longest string (key, value or array element) accepted, in bytes; chat templates are ~10 KB
MAX_STRING_BYTES = 16 * 1024 * 1024

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class GGUFFormatError(ModelLoadError):
    """A GGUF file's header, metadata or tensor table is malformed (truncated, inconsistent or hostile)."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor-table entry. ``dims`` in GGUF order (fastest-varying first, ``[in, out]`` for a weight);
    ``offset`` absolute in the file; ``nbytes`` the encoded size."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFLayout:
    """What :func:`validate_gguf` read: format version, the number of metadata keys, the data alignment,
    where the data section starts and the tensor table, in file order."""

    version: int
    num_kv: int
    alignment: int
    data_offset: int
    tensors: tuple[GGUFTensorInfo, ...]


class Cursor:
    """A read position in ``buf`` that refuses to read past ``size``; failures name ``where``."""

    def __init__(self, buf: mmap.mmap | bytes, size: int, path: Path) -> None:
        self.buf, self.size, self.pos, self.path = buf, size, 0, path

    def fail(self, what: str) -> GGUFFormatError:
        return GGUFFormatError(f"'{self.path}' is not a valid GGUF file: {what}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"truncated at byte {self.pos}: {what} needs {n} bytes, {self.size - self.pos} left")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return value

    def u64(self, what: str) -> int:
        self.need(8, what)
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return value

    def skip_string(self, what: str) -> int:
        """Step over a length-prefixed string; returns its start."""
        n = self.u64(what)
        if n > MAX_STRING_BYTES:
            raise self.fail(f"{what} claims {n} bytes (limit {MAX_STRING_BYTES})")
        self.need(n, what)
        start = self.pos
        self.pos += n
        return start

    def string(self, what: str) -> str:
        start = self.skip_string(what)
        try:
            return bytes(self.buf[start : self.pos]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None
