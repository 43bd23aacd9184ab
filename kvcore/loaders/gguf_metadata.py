"""A GGUF file's metadata as Python values and its tensors' bytes, read straight from the file once
:func:`~kvcore.loaders.gguf_validate.validate_gguf` has bounded every count and offset in it.

The ``gguf`` package's reader makes a numpy view per metadata value (two per vocabulary string: ~200k objects for a
49k-token vocabulary, several times the vocabulary's bytes) before anything asks for a value; this reads each value
once into what the tokenizer and the config take: ``str``, ``int``, ``float``, ``bool`` and lists of them (numeric
arrays through one ``numpy.frombuffer`` each), as the reader's ``ReaderField.contents()`` gives them.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QType

from kvcore.errors import ModelLoadError
from kvcore.loaders.gguf_blocks import file_blocks
from kvcore.loaders.gguf_format import GGUFLayout, GGUFTensorInfo
from kvcore.loaders.gguf_validate import validate_gguf

__all__ = ["read_gguf", "tensor_data"]

_STRING, _ARRAY = 8, 9
#: GGUF value type -> numpy dtype of the fixed-size ones (little-endian)
_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
           12: "<f8"}
_STRUCTS = {t: struct.Struct(f) for t, f in {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                                              10: "<Q", 11: "<q", 12: "<d"}.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
#: the tensor types stored as plain numbers, read as numpy arrays of their own dtype (the rest as bytes)
_PLAIN = {QType.F32: np.float32, QType.F16: np.float16}


def read_gguf(path: Path) -> tuple[GGUFLayout, dict[str, Any]]:
    """The file's checked layout and its metadata (``{key: value}``, in file order). Raises what
    :func:`validate_gguf` raises, and ModelLoadError for a string that is not UTF-8."""
    layout = validate_gguf(path)
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            pos = 4 + 4 + 8 + 8  # magic, version, tensor count, key count
            metadata = {}
            for _ in range(layout.num_kv):
                key, pos = _string(buf, pos)
                (vtype,) = _U32.unpack_from(buf, pos)
                metadata[key], pos = _value(buf, pos + 4, vtype)
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"'{path}' is not a valid GGUF file (truncated or corrupt?): {exc}") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot read '{path}': {exc.strerror or exc}") from None
    return layout, metadata


def _string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = _U64.unpack_from(buf, pos)
    return buf[pos + 8 : pos + 8 + n].decode("utf-8"), pos + 8 + n


def _value(buf: mmap.mmap, pos: int, vtype: int) -> tuple[Any, int]:
    """The value of type ``vtype`` at ``pos`` and the position after it."""
    if vtype == _STRING:
        return _string(buf, pos)
    if vtype != _ARRAY:
        return _STRUCTS[vtype].unpack_from(buf, pos)[0], pos + _STRUCTS[vtype].size
    (etype,) = _U32.unpack_from(buf, pos)
    (count,) = _U64.unpack_from(buf, pos + 4)
    pos += 12
    if etype in _DTYPES:
        values = np.frombuffer(buf, dtype=_DTYPES[etype], count=count, offset=pos)
        return values.tolist(), pos + values.nbytes
    out = []
    for _ in range(count):  # strings (a vocabulary) or arrays
        value, pos = _value(buf, pos, etype)
        out.append(value)
    return out, pos


def tensor_data(path: Path, tensor: GGUFTensorInfo) -> np.ndarray:
    """A tensor's bytes read from the file into a new array: F32 / F16 as their numbers in numpy order (``[out,
    in]``), every other type as ``[rows, bytes per row]`` uint8 blocks."""
    out = file_blocks(path, tensor.offset, tensor.nbytes)()
    qtype = QType(tensor.ggml_type)
    if qtype in _PLAIN:
        return out.view(_PLAIN[qtype]).reshape(tuple(reversed(tensor.dims)))
    rows = int(np.prod(tensor.dims[1:], dtype=np.int64))
    return out.reshape(rows, -1) if len(tensor.dims) > 1 else out.reshape(1, -1)

