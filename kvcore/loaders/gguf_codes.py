"""llama.cpp's quantized blocks decoded into :class:`~kvcore.kernels.group_quant.GroupCodes` (``W = d q + m`` per
group, unsigned codes), exactly: every value :meth:`GroupCodes.dequantize` gives equals the ``gguf`` package's
reference dequantization bit for bit (tests/kernels/test_gguf_codes.py checks each type).

Per type (``q`` unsigned, ``d`` / ``dmin`` float16, ``sc`` / ``mn`` the K-quants' integer sub-scales):

========  =======================  =====  ================================  ==============
type      reference value          group  d                                 m
========  =======================  =====  ================================  ==============
Q4_0      d (q - 8)                32     d                                 -8 d
Q4_1      d q + m                  32     d                                 m
Q5_0      d (q - 16)               32     d                                 -16 d
Q5_1      d q + m                  32     d                                 m
Q8_0      d q_s (signed)           32     d, codes q_s + 128                -128 d
Q4_K      d sc q - dmin mn         32     d sc                              -dmin mn
Q5_K      d sc q - dmin mn         32     d sc                              -dmin mn
Q6_K      d sc (q - 32)            16     d sc (sc signed 8-bit)            -32 d sc
========  =======================  =====  ================================  ==============

``d sc`` has at most 11 + 7 significant bits and ``d q`` at most 24, so float32 holds both exactly; where the
reference subtracts, ``d q + m`` is either exact too (a shifted code) or rounded once, as the reference rounds.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from kvcore.kernels.cpu_kernels import load_kernels
from kvcore.kernels.group_quant import GroupCodes

__all__ = ["CODE_BITS", "CODE_TYPES", "SCALE_OFFSETS", "group_codes", "int4a8_layout"]

_QK = 256  # a K-quant superblock


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of every block, as float32 ``[blocks, 1]``."""
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes ``[blocks, 16]`` -> 32 codes: the low nibbles, then the high ones (llama.cpp's 32-weight blocks)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's 32 fifth bits (a little-endian uint32 per block) -> ``[blocks, 32]`` 0 / 16."""
    bits = qh.copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)
    return ((bits & 1) << 4).astype(np.uint8)


def _scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit sub-scales and sub-mins -> ``([blocks, 8], [blocks, 8])``."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4_0(b):
    d = _f16(b, 0)
    return _nibbles(b[:, 2:]), d, -8 * d, 4


def _q4_1(b):
    return _nibbles(b[:, 4:]), _f16(b, 0), _f16(b, 2), 4


def _q5_0(b):
    d = _f16(b, 0)
    return _nibbles(b[:, 6:]) | _high_bits(b[:, 2:6]), d, -16 * d, 5


def _q5_1(b):
    return _nibbles(b[:, 8:]) | _high_bits(b[:, 4:8]), _f16(b, 0), _f16(b, 2), 5


def _q8_0(b):
    d = _f16(b, 0)
    codes = b[:, 2:] ^ np.uint8(0x80)  # the int8 byte's value + 128, in one pass
    return codes, d, -128 * d, 8


def _k_scales(b):
    sc, mn = _scale_min(b[:, 4:16])
    return _f16(b, 0) * sc.astype(np.float32), -(_f16(b, 2) * mn.astype(np.float32))


def _q4_k(b):
    qs = b[:, 16:144].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    d, m = _k_scales(b)
    return (qs & 0x0F).reshape(-1, _QK), d, m, 4


def _q5_k(b):
    low = b[:, 48:176].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    high = b[:, 16:48].reshape(-1, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    codes = (low & 0x0F).reshape(-1, _QK) | ((high & 1) << 4).reshape(-1, _QK)
    d, m = _k_scales(b)
    return codes, d, m, 5


def _q6_k(b):
    low = b[:, 0:128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    high = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    codes = (low & 0x0F).reshape(-1, _QK) | ((high & 3) << 4).reshape(-1, _QK)
    d = _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)  # [blocks, 16]
    return codes, d, -32 * d, 6


#: type -> (decoder of ``[blocks, bytes]`` -> codes [blocks, weights], d, m [blocks, groups], bits)
_DECODERS = {QType.Q4_0: _q4_0, QType.Q4_1: _q4_1, QType.Q5_0: _q5_0, QType.Q5_1: _q5_1, QType.Q8_0: _q8_0,
             QType.Q4_K: _q4_k, QType.Q5_K: _q5_k, QType.Q6_K: _q6_k}
#: the GGUF types :func:`group_codes` decodes
CODE_TYPES = tuple(_DECODERS)
#: byte offsets of each type's float16 scales / minimums inside a block
SCALE_OFFSETS = {QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q5_0: (0,), QType.Q5_1: (0, 2), QType.Q8_0: (0,),
                 QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,)}
#: the width of each type's codes
CODE_BITS = {QType.Q4_0: 4, QType.Q4_1: 4, QType.Q5_0: 5, QType.Q5_1: 5, QType.Q8_0: 8, QType.Q4_K: 4,
             QType.Q5_K: 5, QType.Q6_K: 6}


def group_codes(qtype: QType, data: np.ndarray, shape: tuple[int, int], type_size: int) -> GroupCodes:
    """``data`` ``[rows, bytes per row]`` of ``qtype`` blocks (``type_size`` bytes each) as :class:`GroupCodes`
    of the logical ``[rows, columns]`` weight."""
    rows, cols = shape
    codes, d, m, bits = _DECODERS[qtype](np.ascontiguousarray(data).reshape(-1, type_size))
    groups = d.size // rows
    return GroupCodes(torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, cols)),
                      torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32).reshape(rows, groups)),
                      torch.from_numpy(np.ascontiguousarray(m, dtype=np.float32).reshape(rows, groups)), bits)


def int4a8_layout(
    qtype: QType, data: np.ndarray, shape: tuple[int, int], out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Q4_0 / Q4_1 blocks ``data`` ``[rows, bytes per row]`` straight in the int4a8 kernel's layout, the
    ``(codes, dm)`` :func:`kvcore.kernels.quant.pack_int4a8` makes of their :func:`group_codes`, bit for bit; None
    for other types, shapes the kernel cannot take, or a Q4_0 offset ``-8 d`` float16 cannot hold (``out`` may then
    be partly written). ``out``: contiguous ``(codes [rows / 16, columns / 32, 256] uint8, dm [rows / 16,
    columns / 32, 2, 16] float16)`` to write them into (and return), such as the place the weight ends in: the
    blocks are copied once.

    No code is decoded: the codes are the blocks' bytes reordered by 16 rows at a time, and ``d`` and ``m`` are their
    float16 scales (``torch.ops.kvcore.q4_blocks_to_int4a8``, one pass over the blocks)."""
    if qtype not in (QType.Q4_0, QType.Q4_1):
        return None
    rows, cols = shape
    if rows % 16 or cols % 32:
        return None
    if out is None:
        out = (torch.empty((rows // 16, cols // 32, 256), dtype=torch.uint8),
               torch.empty((rows // 16, cols // 32, 2, 16), dtype=torch.float16))
    load_kernels()
    blocks = torch.from_numpy(np.ascontiguousarray(data)).view(rows, -1)
    return out if torch.ops.kvcore.q4_blocks_to_int4a8(blocks, qtype == QType.Q4_1, *out) else None
