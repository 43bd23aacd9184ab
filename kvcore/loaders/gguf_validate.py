"""Bounds-checked walk over a GGUF file's header, metadata and tensor table, before any reader trusts it.

The ``gguf`` package's reader believes every count and length it reads: an array that claims 2^40
elements makes it loop past the end of the file while memory grows, and tensor offsets are never
checked against each other. :func:`validate_gguf` reads the same structure with every length checked
against the bytes that remain *before* anything is read or allocated, in the spirit of llama.cpp's
``gguf_init_from_file_impl`` (ggml/src/gguf.cpp):

* header: magic ``GGUF``, version 2 or 3, tensor and key/value counts that the remaining bytes can hold;
* metadata: every key and string length and every array count within the file and within
  :data:`MAX_STRING_BYTES` / :data:`MAX_ARRAY_LENGTH`, value types in range, arrays nested at most
  :data:`MAX_ARRAY_DEPTH` deep, no duplicate key, keys and scalar strings valid UTF-8,
  ``general.alignment`` a uint32 power of two;
* tensor table: names unique and shorter than 64 bytes, 1-4 dimensions each > 0, a known ggml type whose
  block size divides the row, byte size computed exactly (Python integers: no overflow), data offsets
  aligned, inside the file, and no two tensors overlapping.

Walking the 49k-token vocabulary of the embedded SmolLM2 file is a loop over ~100k length prefixes
(docs/models.md, "Hostile model files", has the measured cost). Every failure is a :class:`GGUFFormatError` naming
the file, the place and what is wrong.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

from gguf import GGML_QUANT_SIZES

from kvcore.errors import ModelLoadError
from kvcore.loaders.gguf_format import MAX_STRING_BYTES, Cursor, GGUFFormatError, GGUFLayout, GGUFTensorInfo

__all__ = [
    "GGUFFormatError",
    "GGUFTensorInfo",
    "GGUFLayout",
    "validate_gguf",
    "MAX_STRING_BYTES",
    "MAX_ARRAY_LENGTH",
    "MAX_ARRAY_DEPTH",
    "MAX_TENSOR_NAME",
    "MAX_DIMS",
]

_U64 = struct.Struct("<Q")  # a length prefix

#: most elements in one metadata array (vocabularies are ~10^5 - 10^6 tokens)
MAX_ARRAY_LENGTH = 1 << 26
#: arrays of arrays: llama.cpp reads none; the format allows them, kvcore reads at most this depth
MAX_ARRAY_DEPTH = 2
#: ggml's GGML_MAX_NAME (64, the terminating NUL included)
MAX_TENSOR_NAME = 63
#: ggml's GGML_MAX_DIMS
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32

_STRING, _ARRAY = 8, 9
#: GGUF value type -> size in bytes of the fixed-size ones (bool is one byte)
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_UINT32 = 4
#: ggml type id -> (elements per block, bytes per block)
_BLOCKS = {int(t): (int(b), int(s)) for t, (b, s) in GGML_QUANT_SIZES.items()}
# the smallest possible encodings, which bound a count by the bytes left
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset

def validate_gguf(path: str | os.PathLike[str]) -> GGUFLayout:
    """Check ``path``'s GGUF structure (see the module docstring) without reading tensor data.

    Raises :class:`GGUFFormatError` (a ModelLoadError) for anything malformed, ModelLoadError when the
    file cannot be read.
    """
    path = Path(path)
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise GGUFFormatError(f"'{path}' is not a valid GGUF file: it is empty")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _walk(Cursor(buf, size, path))
    except OSError as exc:
        raise ModelLoadError(f"cannot read '{path}': {exc.strerror or exc}") from None


def _walk(cur: Cursor) -> GGUFLayout:
    cur.need(4, "the magic")
    magic = bytes(cur.buf[0:4])
    if magic != b"GGUF":
        raise cur.fail(f"bad magic {magic!r} (expected b'GGUF')")
    cur.pos = 4
    version = cur.u32("the version")
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise cur.fail(f"unsupported version {version}{hint}; kvcore reads versions 2 and 3")
    num_tensors = cur.u64("the tensor count")
    num_kv = cur.u64("the metadata key count")
    left = cur.size - cur.pos
    if num_kv > left // _MIN_KV_BYTES:
        raise cur.fail(f"header claims {num_kv} metadata keys; {left} bytes cannot hold them")
    alignment = _metadata(cur, num_kv)
    left = cur.size - cur.pos
    if num_tensors > left // _MIN_TENSOR_INFO_BYTES:
        raise cur.fail(f"header claims {num_tensors} tensors; the {left} bytes left cannot hold their table")
    infos = [_tensor_info(cur, i) for i in range(num_tensors)]
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = _place(cur, infos, data_offset, alignment)
    return GGUFLayout(version, num_kv, alignment, data_offset, tensors)


def _metadata(cur: Cursor, num_kv: int) -> int:
    """Walk the key/value pairs; returns ``general.alignment`` (default 32)."""
    keys: set[str] = set()
    alignment = DEFAULT_ALIGNMENT
    for i in range(num_kv):
        key = cur.string(f"metadata key #{i}")
        if key in keys:
            raise cur.fail(f"duplicate metadata key '{key}'")
        keys.add(key)
        vtype = cur.u32(f"the type of '{key}'")
        if key == "general.alignment":
            alignment = _alignment(cur, key, vtype)
        else:
            _value(cur, key, vtype, 0)
    return alignment


def _alignment(cur: Cursor, key: str, vtype: int) -> int:
    if vtype != _UINT32:  # llama.cpp and the gguf reader read it as uint32 only
        raise cur.fail(f"'{key}' must be a uint32 (GGUF type 4), not GGUF type {vtype}")
    value = cur.u32(f"the value of '{key}'")
    if value <= 0 or value & (value - 1):
        raise cur.fail(f"'{key}' is {value}, not a power of two")
    return value


def _value(cur: Cursor, key: str, vtype: int, depth: int) -> None:
    """Step over one value of type ``vtype`` (recursing into arrays up to MAX_ARRAY_DEPTH)."""
    if vtype in _FIXED_SIZES:
        cur.need(_FIXED_SIZES[vtype], f"the value of '{key}'")
        cur.pos += _FIXED_SIZES[vtype]
    elif vtype == _STRING:
        # scalar strings are decoded (a chat template that is not UTF-8 is named here); array elements
        # (vocabularies) are only bounded: the reader decodes them and reports bad bytes itself
        if depth == 0:
            cur.string(f"the value of '{key}'")
        else:
            cur.skip_string(f"an element of '{key}'")
    elif vtype == _ARRAY:
        if depth >= MAX_ARRAY_DEPTH:
            raise cur.fail(f"'{key}' nests arrays deeper than {MAX_ARRAY_DEPTH}")
        etype = cur.u32(f"the element type of '{key}'")
        count = cur.u64(f"the length of '{key}'")
        if count > MAX_ARRAY_LENGTH:
            raise cur.fail(f"array '{key}' claims {count} elements (limit {MAX_ARRAY_LENGTH})")
        if etype in _FIXED_SIZES:
            cur.need(count * _FIXED_SIZES[etype], f"the {count} elements of '{key}'")
            cur.pos += count * _FIXED_SIZES[etype]
        elif etype == _STRING:
            cur.need(count * 8, f"the {count} strings of '{key}'")  # every one has an 8-byte length
            _skip_strings(cur, key, count)
        elif etype == _ARRAY:
            cur.need(count * 12, f"the {count} arrays of '{key}'")  # each has a type and a length
            for _ in range(count):
                _value(cur, key, _ARRAY, depth + 1)
        else:
            raise cur.fail(f"array '{key}' has invalid element type {etype}")
    else:
        raise cur.fail(f"metadata '{key}' has invalid value type {vtype}")


def _skip_strings(cur: Cursor, key: str, count: int) -> None:
    """The hot loop (one pass per vocabulary entry): locals only, one unpack and two compares each."""
    buf, size, pos = cur.buf, cur.size, cur.pos
    unpack = _U64.unpack_from
    for i in range(count):
        if size - pos < 8:
            cur.pos = pos
            cur.need(8, f"element {i} of '{key}'")
        (n,) = unpack(buf, pos)
        pos += 8
        if n > size - pos or n > MAX_STRING_BYTES:
            cur.pos = pos
            raise cur.fail(f"element {i} of '{key}' claims {n} bytes, {size - pos} left in the file")
        pos += n
    cur.pos = pos


def _tensor_info(cur: Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string(f"the name of tensor #{index}")
    if len(name.encode("utf-8")) > MAX_TENSOR_NAME:
        raise cur.fail(f"tensor #{index} has a name of {len(name.encode())} bytes (limit {MAX_TENSOR_NAME})")
    num_dims = cur.u32(f"the dimension count of '{name}'")
    if not 1 <= num_dims <= MAX_DIMS:
        raise cur.fail(f"tensor '{name}' has {num_dims} dimensions (1 to {MAX_DIMS} allowed)")
    cur.need(8 * num_dims, f"the dimensions of '{name}'")
    dims = struct.unpack_from(f"<{num_dims}q", cur.buf, cur.pos)
    cur.pos += 8 * num_dims
    if any(d <= 0 for d in dims):
        raise cur.fail(f"tensor '{name}' has dimensions {list(dims)}; each must be > 0")
    ggml_type = cur.u32(f"the type of '{name}'")
    offset = cur.u64(f"the data offset of '{name}'")
    return name, dims, ggml_type, offset


def _place(
    cur: Cursor, infos: list[tuple[str, tuple[int, ...], int, int]], data_offset: int, alignment: int
) -> tuple[GGUFTensorInfo, ...]:
    """Type, size and position checks of the tensor table; the data section starts at ``data_offset``."""
    names: set[str] = set()
    tensors = []
    data_bytes = cur.size - data_offset
    for name, dims, ggml_type, offset in infos:
        if name in names:
            raise cur.fail(f"duplicate tensor name '{name}'")
        names.add(name)
        if ggml_type not in _BLOCKS:
            raise cur.fail(f"tensor '{name}' has unknown ggml type {ggml_type}")
        block, block_bytes = _BLOCKS[ggml_type]
        if dims[0] % block:
            raise cur.fail(f"tensor '{name}' has rows of {dims[0]} elements, not a multiple of its block size {block}")
        rows = 1
        for d in dims[1:]:
            rows *= d
        nbytes = dims[0] // block * block_bytes * rows
        if offset % alignment:
            raise cur.fail(f"tensor '{name}' data offset {offset} is not a multiple of the alignment {alignment}")
        if offset > data_bytes or nbytes > data_bytes - offset:
            raise cur.fail(
                f"tensor '{name}' ({nbytes} bytes at data offset {offset}) ends past the end of the file "
                f"(data section holds {max(data_bytes, 0)} bytes)"
            )
        tensors.append(GGUFTensorInfo(name, tuple(dims), ggml_type, data_offset + offset, nbytes))
    ordered = sorted(tensors, key=lambda t: t.offset)
    for prev, cur_t in zip(ordered, ordered[1:]):
        if cur_t.offset < prev.offset + prev.nbytes:
            raise cur.fail(f"tensors '{prev.name}' and '{cur_t.name}' overlap in the data section")
    return tuple(tensors)
