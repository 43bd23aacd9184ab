"""Fast CPU matmuls for the decoder's dense weights: layout choice, oneDNN prepacking, split single-row GEMVs.

Every matmul weight of a :class:`~kvcore.model.decoder.DecoderModel` is called as ``y = w(x)`` (``x [T, in]`` ->
``[T, out]``): a :class:`DenseLinear` here, or a quantized one from :mod:`kvcore.kernels.quant`. :class:`DenseMatmuls`
picks, per forward, how each dense weight runs:

* float32 on CPU, one row: ``parts`` partial GEMVs over the column-major weight (:func:`linear`);
* float32 on CPU, 2+ rows: ``F.linear`` on the column-major weight (MKL; a prepacked copy would double the
  reference model's memory for prefills only a little faster);
* bfloat16 on a CPU with AVX512_BF16, up to :data:`BF16_KERNEL_MAX_ROWS` rows (:data:`BF16_KERNEL_MAX_ROWS_AMX` with
  AMX): kvcore's ``bf16_linear`` kernel on a copy repacked for ``vdpbf16ps`` (:class:`Bf16Linear`; a decode step's
  weights stream at close to the memory bandwidth); more rows: ``F.linear`` (oneDNN's GEMM, as fast as on a
  prepacked copy at those sizes);
* bfloat16 where the kernel cannot run (no C++ compiler to build it) on a CPU with native bfloat16 dot products
  (:func:`kvcore.kernels.cpu.cpu_features`), any rows: oneDNN on a prepacked copy (plain bfloat16 ``F.linear`` reads its
  weights at a fraction of the memory bandwidth);
* anything else: ``F.linear``.

Weights below :data:`COLUMN_MAJOR_MIN_NUMEL` elements, and for the kernel weights whose shape it cannot take
(output rows not a multiple of 16, input columns not of 32), always run ``F.linear``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvcore.kernels.cpu import cpu_features
from kvcore.kernels.cpu_kernels import bf16_linear_ready

__all__ = ["BF16_KERNEL_MAX_ROWS", "BF16_KERNEL_MAX_ROWS_AMX", "COLUMN_MAJOR_MIN_NUMEL", "Bf16Linear", "DenseLinear",
           "DenseMatmuls", "prepack", "pack_bf16", "row_bucket", "weight_version", "linear", "packed_linear",
           "set_layout"]

#: weights smaller than this (elements; 512 KiB in float32, about a core's L2) keep row-major and are not
#: prepacked: cache-resident GEMVs gain nothing, and small test models keep their exact historical numerics
COLUMN_MAJOR_MIN_NUMEL = 1 << 17


#: bfloat16 forwards of up to this many rows run kvcore's bf16_linear kernel (where it runs); past it plain
#: F.linear (oneDNN's GEMM, compute-bound from there on) is as fast
BF16_KERNEL_MAX_ROWS = 128
#: the same limit on CPUs with AMX, whose tiles oneDNN uses for bfloat16 GEMMs: only decode-sized batches (memory-bound
#: streams over the weights) stay on the kernel; not measured here (no AMX on this project's machines)
BF16_KERNEL_MAX_ROWS_AMX = 16


def prepack(p: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a big ``[out, in]`` float32 or bfloat16 weight (None for small ones: plain F.linear)."""
    if p.numel() < COLUMN_MAJOR_MIN_NUMEL or not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(p.detach().contiguous(), 8)  # blocked for ~8-row inputs


def row_bucket(rows: int) -> int:
    """The row count a prepacked GEMM of ``rows`` rows runs at: a power of two up to 16, then the next
    multiple of 1/8 of the power of two below (at most 12.5% padding). oneDNN keeps state per input
    shape for as long as the process lives, so exact row counts (every prompt length a server sees)
    made memory grow without bound; these buckets cap it at 8 shapes per octave."""
    if rows <= 16:
        return 1 << max(rows - 1, 0).bit_length()
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def weight_version(p: torch.Tensor) -> int:
    """In-place update counter (inference-mode tensors have none: their packed copy is keyed on storage only)."""
    try:
        return p._version
    except RuntimeError:
        return -1


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, parts: int = 1) -> torch.Tensor:
    """``F.linear(x, weight)``, via oneDNN when ``weight`` has a prepacked copy, or, for one row and a big
    column-major weight, as ``parts`` partial GEMVs over slices of the input dimension in one ``bmm``
    (ATen runs the batch in parallel: one thread per slice; MKL's single GEMV leaves half the memory
    bandwidth of a 2-core machine unused), summed."""
    if packed is not None:
        if torch.compiler.is_compiling():  # decode batches: few shapes (execution/compile.py), no bucketing needed
            return packed_linear(x.contiguous(), packed, weight.shape[0])
        rows = x.shape[0]
        padded = row_bucket(rows)
        if padded != rows:
            x = F.pad(x, (0, 0, 0, padded - rows))
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")[:rows]
    if parts > 1 and weight.stride(0) == 1 and weight.numel() >= COLUMN_MAJOR_MIN_NUMEL:
        n, k = weight.shape
        if k % parts == 0:
            partial = torch.bmm(x.reshape(parts, 1, k // parts), weight.t().view(parts, k // parts, n))  # [P, 1, N]
            return partial.sum(0)
    return F.linear(x, weight)


@torch.library.custom_op("kvcore::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x [T, in] @ W.T`` on oneDNN's prepacked ``W``, as an opaque op for ``torch.compile`` (inductor cannot
    lower the prepacked call itself; eager code calls oneDNN directly, without this wrapper's overhead)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class DenseLinear:
    """A dense ``[out, in]`` weight as a callable ``x [T, in] -> [T, out]`` (see :func:`linear`). It reads
    ``weight`` at call time, so in-place updates of an unpacked weight are seen."""

    __slots__ = ("weight", "packed", "parts")
    format = "float"

    def __init__(self, weight: torch.Tensor, packed: torch.Tensor | None = None, parts: int = 1) -> None:
        self.weight, self.packed, self.parts = weight, packed, parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed, self.parts)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (self.packed.nbytes if self.packed is not None else 0)


def pack_bf16(p: torch.Tensor) -> torch.Tensor | None:
    """A big bfloat16 ``[N, K]`` weight in the bf16_linear kernel's layout ``[N / 16, K / 2, 16, 2]`` (per block of
    16 output rows and pair of input columns, the 16 rows' pairs), or None where the kernel does not apply (a small
    weight, or N not a multiple of 16 or K of 32)."""
    n, k = p.shape
    if p.numel() < COLUMN_MAJOR_MIN_NUMEL or n % 16 or k % 32:
        return None
    return p.detach().reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


class Bf16Linear:
    """A dense bfloat16 ``[out, in]`` weight on kvcore's ``bf16_linear`` kernel (``csrc/bf16_linear.cpp``),
    ``x [T, in] -> [T, out]``: float32 sums of bfloat16 products rounded once, each row on its own (a row's result
    does not depend on the others in its batch)."""

    __slots__ = ("weight", "packed")
    format = "float"

    def __init__(self, weight: torch.Tensor, packed: torch.Tensor) -> None:
        self.weight, self.packed = weight, packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvcore.bf16_linear(x.contiguous(), self.packed)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.packed.nbytes


class DenseMatmuls:
    """The callables (:class:`DenseLinear`, :class:`Bf16Linear`) of a model's dense weight lists for a forward of
    ``num_rows`` rows.

    Prepacked copies (oneDNN's, or the bf16_linear kernel's) are built on first use and rebuilt when a weight
    changes (storage or in-place version); they cost one extra copy of those weights in memory, and pay because
    MKL repacks the whole weight on every few-row float32 call (bfloat16: at one row too)."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[tuple, dict[str, list[DenseLinear]]]] = {}
        self.can_prepack = True  # False once a prepack failed (no oneDNN in this torch build)

    def reset(self) -> None:
        self._cache.clear()

    def mode(self, p: torch.Tensor, num_rows: int, use_packed: bool) -> str:
        """``kernel``, ``packed``, ``gemv`` or ``plain``: how weights like ``p`` run for ``num_rows`` rows."""
        if p.device.type != "cpu":
            return "plain"
        packs = use_packed and self.can_prepack
        if p.dtype == torch.float32:  # the reference path keeps one copy: no prepacking (little faster for prefills)
            return "gemv" if num_rows == 1 else "plain"
        if p.dtype == torch.bfloat16 and use_packed and bf16_linear_ready():
            limit = BF16_KERNEL_MAX_ROWS_AMX if cpu_features().amx else BF16_KERNEL_MAX_ROWS
            return "kernel" if num_rows <= limit else "plain"
        if p.dtype == torch.bfloat16 and packs and cpu_features().bf16_matmul:
            return "packed"
        return "plain"

    def get(self, lists: dict[str, Sequence[torch.Tensor]], num_rows: int, use_packed: bool = True):
        """``{name: [DenseLinear per weight]}`` for ``lists`` (``{name: [weight [out, in], ...]}``)."""
        first = next(iter(lists.values()))[0]
        mode = self.mode(first, num_rows, use_packed)
        params = [p for plist in lists.values() for p in plist]
        if mode in ("packed", "kernel"):
            key: tuple = tuple((p.data_ptr(), weight_version(p)) for p in params)
        else:  # the callables read their Parameter at call time: only a replaced Parameter matters
            key = (torch.get_num_threads() if mode == "gemv" else 1, *map(id, params))
        cached = self._cache.get(mode)
        if cached is not None and cached[0] == key:
            return cached[1]
        self._cache.pop(mode, None)  # free an outdated packed copy before building the next
        if mode == "kernel":
            with torch.no_grad():
                built = {n: [_kernel_linear(p) for p in plist] for n, plist in lists.items()}
        elif mode == "packed":
            try:
                with torch.no_grad():
                    built = {n: [DenseLinear(p, prepack(p)) for p in plist] for n, plist in lists.items()}
            except (RuntimeError, AttributeError):  # no oneDNN in this torch build: plain F.linear from now on
                self.can_prepack = False
                return self.get(lists, num_rows, use_packed)
        else:
            built = {n: [DenseLinear(p, None, key[0]) for p in plist] for n, plist in lists.items()}
        self._cache[mode] = (key, built)
        return built


def _kernel_linear(p: torch.Tensor) -> Bf16Linear | DenseLinear:
    packed = pack_bf16(p)
    return DenseLinear(p) if packed is None else Bf16Linear(p, packed)


def set_layout(p: nn.Parameter, column_major: bool, values: bool = True) -> None:
    """Store ``p`` (``[out, in]``) column-major or row-major; without ``values`` (a parameter not written yet) the
    new storage is allocated, not copied: copying would write every page of a weight a quantized model then drops."""
    column_major = column_major and p.numel() >= COLUMN_MAJOR_MIN_NUMEL
    is_column_major = p.dim() == 2 and p.stride() == (1, p.shape[0])
    if column_major and not is_column_major:
        p.data = (p.data.t().contiguous().t() if values else
                  torch.empty_strided(p.shape, (1, p.shape[0]), dtype=p.dtype, device=p.device))
    elif not column_major and not p.is_contiguous():
        p.data = p.data.contiguous()
