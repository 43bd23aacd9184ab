"""Quantized linear weights: int4 group-wise and int8 per-channel (torch's CPU weight-only kernels), and int4
with int8 activations (kvcore's own kernel).

A decoder's matmul weights can be stored in one of these formats (``EngineConfig.weights``, ``--weights``):

* ``float``: dense in the model dtype (the reference path: float32 equals transformers token for token).
* ``int4``: 4-bit codes, a scale and an offset per group of ``group_size`` (32) input columns:
  ``W = (q - 8) * s + z``, run by ``aten._weight_int4pack_mm_for_cpu``. llama.cpp's Q4_0 / Q4_1 / Q4_K blocks map
  onto it (:mod:`kvcore.loaders.gguf_blocks`); float weights are quantized with each group's min/max (gpt-fast's).
* ``int4a8``: the ``int4`` weights (groups of 32), every matmul on kvcore's own kernel with the activations
  quantized to int8 per row and group of 32 (:class:`Int4A8Linear`; AVX512-VNNI). Faster than ``int4`` and less
  exact (docs/formats-and-kernels.md states the accuracy of each format).
* ``int8``: int8 codes with one scale per output row, symmetric (``W = q * s``, ``s = max|w| / 127``),
  run by ``aten._weight_int8pack_mm``; always quantized at load from the float (or dequantized) weights.
* ``gguf``: a GGUF's layer weights as stored, Q4_* on the ``int4a8`` kernel, Q5_*, Q6_K, Q8_0 on the int8-group one
  (:mod:`kvcore.kernels.group_quant`). ``auto``: see :func:`kvcore.engine.defaults.choose_defaults`.

torch's kernels (``int4``, ``int8``) take bfloat16 activations on CPU (their float32 paths are reference loops);
kvcore's int8-activation kernels (``int4a8``, ``gguf``) quantize float32 or bfloat16 activations alike. The LM head
has formats of its own (:mod:`kvcore.model.lm_head`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvcore.errors import ConfigError
from kvcore.interfaces.dtypes import dtype_name

__all__ = ["WEIGHT_FORMATS", "QUANTIZED_FORMATS", "DEFAULT_GROUP_SIZE", "Int4Groups", "Int4Linear",
           "check_weight_format", "check_runnable", "quantized_reasons", "unpack_codes",
           "int4_dense", "pack_rows", "Int4A8Linear", "pack_int4a8"]

#: every value of ``EngineConfig.weights`` with what it means (the CLI help and errors list them)
WEIGHT_FORMATS = {
    "auto": "int4 for a Q4_0/Q4_1 GGUF in bfloat16 on CPU, else float",
    "float": "dense weights in the model dtype (exact reference)",
    "int8": "int8 per-output-channel weight-only (quantized at load)",
    "int4": "int4 group-wise weight-only (GGUF Q4_0/Q4_1 as stored, others quantized at load)",
    "int4a8": "int4 weights, matmuls with int8 activations per group of 32 (kvcore's kernel, AVX512-VNNI)",
    "gguf": "a GGUF's Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 blocks as stored, int8 activations (AVX512-VNNI)",
}
QUANTIZED_FORMATS = ("int8", "int4", "int4a8", "gguf")
#: llama.cpp's block length: Q4_0/Q4_1/Q8_0 blocks are groups of 32
DEFAULT_GROUP_SIZE = 32
_GROUP_SIZES = (32, 64, 128, 256)  # what the int4 kernel accepts
_QUANTIZE_ROWS = 1024  # rows per step of Int4Groups.from_float
_ACTIVATIONS = dict.fromkeys(("int4a8", "gguf"), (torch.float32, torch.bfloat16))  # kvcore's kernels; else bf16


def check_weight_format(name: str) -> str:
    """``name`` if it is a weight format, else ConfigError listing them."""
    if name not in WEIGHT_FORMATS:
        raise ConfigError(f"unknown weights format '{name}' (choose from: {', '.join(WEIGHT_FORMATS)})")
    return name


def check_runnable(fmt: str, dtype: torch.dtype, device: torch.device | str) -> str:
    """``fmt`` if it is a weight format that runs with ``dtype`` on ``device``, else ConfigError saying why."""
    reasons = quantized_reasons(check_weight_format(fmt), dtype, device)
    if reasons:
        raise ConfigError(f"weights '{fmt}' cannot run here: {'; '.join(reasons)}")
    return fmt


def quantized_reasons(fmt: str, dtype: torch.dtype, device: torch.device | str) -> list[str]:
    """Why weights in ``fmt`` cannot run with ``dtype`` activations on ``device`` (empty: they can)."""
    if fmt not in QUANTIZED_FORMATS:
        return []
    reasons = []
    if torch.device(device).type != "cpu":
        reasons.append(f"{fmt} weights run on CPU only (kvcore has no {torch.device(device).type} packing for them)")
    if fmt in ("int4a8", "gguf"):
        from kvcore.kernels.cpu_kernels import int4a8_reasons

        reasons += int4a8_reasons(fmt)
    accepted = _ACTIVATIONS.get(fmt, (torch.bfloat16,))
    if dtype not in accepted:
        why = "" if fmt in _ACTIVATIONS else (f" (torch's fast {fmt} kernels take bfloat16 activations; with "
                                              f"{dtype_name(dtype)} they run a slow reference loop)")
        reasons.append(f"{fmt} weights need dtype {' or '.join(map(dtype_name, accepted))}{why}: use --dtype "
                       f"{dtype_name(accepted[0])}")
    return reasons


@dataclass
class Int4Groups:
    """A ``[N, K]`` weight as 4-bit codes with a scale and an offset per group of ``G`` input columns:
    ``W[n, k] = (q[n, k] - 8) * scales[n, k // G] + zeros[n, k // G]`` (the int4 kernel's convention)."""

    q: torch.Tensor  # [N, K] uint8 in 0..15
    scales: torch.Tensor  # [N, K // G] float32
    zeros: torch.Tensor  # [N, K // G] float32

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scales.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @classmethod
    def from_float(
        cls, w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, dtype: torch.dtype = torch.bfloat16
    ) -> Int4Groups:
        """Asymmetric min/max quantization per group (gpt-fast's ``group_quantize_tensor``), against the scales and
        offsets rounded to ``dtype`` as the kernel reads them: every weight is off by at most half a step, plus the
        offset's rounding (``|z| 2^-9`` in bfloat16) at the group's extremes."""
        n, k = w.shape
        groups = k // group_size
        out = cls(torch.empty(n, k, dtype=torch.uint8), torch.empty(n, groups), torch.empty(n, groups))
        for a in range(0, n, _QUANTIZE_ROWS):  # row chunks of a float32 copy, worked in place: small temporaries
            g = w[a : a + _QUANTIZE_ROWS].detach().to(torch.float32, copy=True).reshape(-1, groups, group_size)
            lo, hi = torch.aminmax(g, dim=-1)
            scales = ((hi - lo) / 15).clamp(min=1e-12).to(dtype).float()  # constant group: any scale, z = its value
            zeros = (lo + 8 * scales).to(dtype).float()
            g.sub_(zeros[..., None]).div_(scales[..., None]).round_().add_(8).clamp_(0, 15)
            out.q[a : a + _QUANTIZE_ROWS] = g.reshape(-1, k)
            out.scales[a : a + _QUANTIZE_ROWS], out.zeros[a : a + _QUANTIZE_ROWS] = scales, zeros
        return out

    @staticmethod
    def cat(parts: list[Int4Groups]) -> Int4Groups:
        """Rows of ``parts`` stacked (fused Q/K/V or gate/up projections); same group size."""
        return Int4Groups(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scales", "zeros")))

    @property
    def d_and_m(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(d, m)`` of the same weight as ``W = d q + m`` (``d = s``, ``m = z - 8 s``)."""
        return self.scales, self.zeros - 8 * self.scales

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` float32."""
        n, k = self.q.shape
        q = self.q.float().reshape(n, -1, self.group_size)
        return ((q - 8) * self.scales[..., None] + self.zeros[..., None]).reshape(n, k)


class Int4Linear:
    """``y = x @ W.T`` with ``W`` in :class:`Int4Groups` form, packed for the CPU int4 kernel.

    The kernel's scales and offsets are in the activation dtype (bfloat16): each is rounded to 8 bits of
    mantissa, on top of the activations' own bfloat16 rounding."""

    format = "int4"

    def __init__(self, groups: Int4Groups, dtype: torch.dtype = torch.bfloat16) -> None:
        n, k = groups.shape
        if not self.fits(n, k, groups.group_size):
            raise ValueError(f"int4 kernel cannot take a [{n}, {k}] weight in groups of {groups.group_size}")
        self.shape, self.group_size, self.dtype = (n, k), groups.group_size, dtype
        # innerKTiles=2: the CPU kernel's layout (it reads 2 x 16 codes per tile)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.q.to(torch.int32).contiguous(), 2)
        self.scales_and_zeros = torch.stack([groups.scales.t(), groups.zeros.t()], -1).to(dtype).contiguous()

    @staticmethod
    def fits(n: int, k: int, group_size: int) -> bool:
        """The kernel's shape rules: output rows in multiples of 16, whole groups of 32..256 columns."""
        return n % 16 == 0 and group_size in _GROUP_SIZES and k % group_size == 0

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, K]`` in ``self.dtype`` -> ``[T, N]``."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group_size,
                                                           self.scales_and_zeros)

    @property
    def unpackable(self) -> bool:
        """Whether :func:`int4_dense` can read this weight's packed codes."""
        rows = pack_rows()
        return rows is not None and self.shape[0] % rows == 0

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` float32: the weight the kernel multiplies by (scales rounded to ``self.dtype``), read
        back through the kernel itself (``I @ W.T``: exact, every sum has one non-zero term)."""
        eye = torch.eye(self.shape[1], dtype=self.dtype)
        return self(eye).float().t().contiguous()


class Int4A8Linear:
    """``y = x @ W.T`` on kvcore's own kernel, ``torch.ops.kvcore.int4_linear`` (``csrc/int4_linear.cpp``),
    for any number of rows: activations quantized to int8 per row and group of 32 (as llama.cpp's Q8 blocks),
    weight codes times activation codes summed by AVX512-VNNI, scales applied per group in float32. ``d`` and
    ``m`` (``W = d q + m``) are kept in float16 where that is exact (GGUF Q4_0 / Q4_1 blocks, weights quantized at
    load), else in float32 (Q4_K, :class:`~kvcore.kernels.group_quant.GroupCodes`). ``groups``: an
    :class:`Int4Groups` or 4-bit ``GroupCodes`` in groups of 32. Each row is quantized and
    computed on its own: a row's result does not depend on the others in its batch (decode steps and prefills of
    the same row agree)."""

    format = "int4a8"

    def __init__(self, groups, dtype: torch.dtype = torch.bfloat16) -> None:
        n, k = groups.shape
        if not self.fits(n, k, groups.group_size):
            raise ValueError(f"int4a8 kernel cannot take a [{n}, {k}] weight in groups of {groups.group_size}")
        from kvcore.kernels.cpu_kernels import load_kernels

        load_kernels()
        self.shape, self.group_size, self.dtype = (n, k), groups.group_size, dtype
        self.codes, self.dm = pack_int4a8(groups)

    @classmethod
    def from_layout(cls, codes: torch.Tensor, dm: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> Int4A8Linear:
        """The weight whose :func:`pack_int4a8` output is ``(codes, dm)`` (already in the kernel's layout)."""
        from kvcore.kernels.cpu_kernels import load_kernels

        load_kernels()
        out = cls.__new__(cls)
        out.shape, out.group_size, out.dtype = (codes.shape[0] * 16, codes.shape[1] * A8_GROUP), A8_GROUP, dtype
        out.codes, out.dm = codes, dm
        return out

    @staticmethod
    def fits(n: int, k: int, group_size: int) -> bool:
        """The kernel's shape rules: output rows in multiples of 16, groups of 32 columns."""
        return n % 16 == 0 and group_size == A8_GROUP and k % A8_GROUP == 0

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.dm.nbytes

    def relocate(self, take) -> None:
        """Hold the codes and scales where ``take`` copies them (:func:`~kvcore.kernels.huge_pages.move_into_huge_pages`
        calls it)."""
        self.codes = take(self.codes)
        self.dm = take(self.dm)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, K]`` in ``self.dtype`` -> ``[T, N]``."""
        return torch.ops.kvcore.int4_linear(x.contiguous(), self.codes, self.dm)


A8_GROUP = 32


def pack_int4a8(groups, out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [N / 16, K / 32, 256] uint8, dm [N / 16, K / 32, 2, 16])`` in the int4a8 kernel's layout:
    per block of 16 output rows and group of 32 columns, byte ``64 j + 4 row + i`` holds code ``4 j + i`` of that
    row in its low nibble and code ``16 + 4 j + i`` in its high one; then ``d`` and ``m`` of the 16 rows
    (``W = d q + m``, ``groups.d_and_m``): float16 for :class:`Int4Groups` (their values are float16 or bfloat16
    ones, or rounded so at load), for other codes float16 where every value is exactly a float16, else float32.
    ``out``: contiguous tensors of those shapes (``dm`` of that dtype) to write them into, and return."""
    n, k = groups.shape
    q = groups.q.view(n // 16, 16, k // A8_GROUP, 2, 4, 4)  # block, row, group, half, j, i
    q = q.permute(0, 2, 3, 4, 1, 5)  # block, group, half, j, row, i
    d, m = groups.d_and_m
    dm = torch.stack([t.view(n // 16, 16, -1).permute(0, 2, 1) for t in (d, m)], dim=2).float()
    if out is None:
        half = dm.to(torch.float16)
        exact = isinstance(groups, Int4Groups) or torch.equal(half.float(), dm)
        out = torch.empty((n // 16, k // A8_GROUP, 256), dtype=torch.uint8), torch.empty_like(half if exact else dm)
    out[1].copy_(dm)
    torch.bitwise_or(q[:, :, 0], q[:, :, 1] << 4, out=out[0].view(n // 16, k // A8_GROUP, 4, 16, 4))
    return out


#: the CPU int4 kernel's packed layouts (torch 2.13): blocks of R output rows, R = 64 where torch runs its AVX-512
#: kernels and 32 on AVX2; for each block and input column, R / 2 bytes, byte ``j`` holding row ``j`` in its low
#: nibble and row ``j + R / 2`` in its high one
_PACK_ROWS = (64, 32)


def unpack_codes(packed: torch.Tensor, n: int, k: int, block_rows: int) -> torch.Tensor:
    """The ``[N, K]`` 4-bit codes (uint8 0..15) of an :class:`Int4Linear`'s ``packed`` weight, packed in blocks
    of ``block_rows`` (:func:`pack_rows`: this torch build's, checked once)."""
    blocks = packed.view(n // block_rows, k, block_rows // 2)
    codes = torch.cat([blocks & 15, blocks >> 4], dim=2)  # [N / R, K, R]
    return codes.transpose(1, 2).reshape(n, k)


def int4_dense(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, block_rows: int) -> torch.Tensor:
    """An :class:`Int4Linear`'s weight ``[N, K]`` dense in the dtype of its scales: ``(q - 8) s + z`` computed in
    float32 as the kernel computes it, rounded once (``block_rows``: :func:`pack_rows`). Pure tensor code, for
    ``torch.compile`` to fuse."""
    n, k = packed.shape[0], packed.shape[1] * 2
    q = unpack_codes(packed, n, k, block_rows).view(n, k // group_size, group_size).float()
    scales = scales_and_zeros[..., 0].t().unsqueeze(-1).float()  # [N, K / G, 1]
    zeros = scales_and_zeros[..., 1].t().unsqueeze(-1).float()
    return ((q - 8) * scales + zeros).to(scales_and_zeros.dtype).view(n, k)


@functools.cache
def pack_rows() -> int | None:
    """The rows per block of this torch build's int4 packing on this CPU (the layout that inverts its packer on a
    random matrix), or None when it is none of :data:`_PACK_ROWS` (then nothing here reads its codes)."""
    codes = torch.randint(0, 16, (2 * max(_PACK_ROWS), 64), generator=torch.Generator().manual_seed(0),
                          dtype=torch.int32)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    except RuntimeError:  # another layout or size: not ours to read
        return None
    return next((rows for rows in _PACK_ROWS if torch.equal(unpack_codes(packed, *codes.shape, rows).int(), codes)),
                None)
