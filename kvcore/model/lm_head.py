"""The LM head formats (``EngineConfig.lm_head``, ``--lm-head``): how hidden states become vocabulary logits.

* ``dense``: ``hidden @ W.T`` in the model dtype (the default; the reference).
* ``int4``: an int4 copy of the head (groups of 32 input columns, :class:`~kvcore.kernels.quant.Int4Linear`) scores the
  whole vocabulary, then the ``top_k`` (64) best candidates of each row are scored again with the dense
  weights and those exact logits replace theirs (kvcore's C++ kernel ``rescore_top_k``: one pass over the
  row's estimates, then 64 dot products; it needs kvcore's CPU kernels, :mod:`kvcore.kernels.cpu_kernels`). For a
  batch-1 decode step of a small model with a large vocabulary the head is the biggest single matmul; int4 reads
  a quarter of its bytes. What stays approximate is the tail: a logit outside the
  top 64 carries int4 rounding (about one logit), which shifts the sampled
  distribution's far tail only. Greedy decoding, top-k up to 64 and the reported top logprobs read exact logits
  whenever the exact best candidates are among the int4 top 64 (docs/formats-and-kernels.md states the
  accuracy).
  Batches of more than :data:`INT4_MAX_ROWS` rows run the dense head: the int4 kernel's cost grows with the
  rows, and from about four rows oneDNN's bfloat16 GEMM is as fast. With ``int4a8`` weights the scores come
  from that format's int8-activation kernel (:class:`~kvcore.kernels.quant.Int4A8Linear`) for up to
  :data:`A8_MAX_ROWS` rows (the batch sizes of decode steps, where it is faster than the dense head); the
  rescored top 64 stay exact.
* ``int8``: the head's 8-bit codes per group of 32 (a GGUF table's Q8_0 blocks as stored; a dense head quantized
  symmetrically, as Q8_0 does) on kvcore's int8-activation kernel (:class:`~kvcore.kernels.group_quant.Int8GroupLinear`)
  for up to :data:`A8_MAX_ROWS` rows (llama.cpp's own head for such a file), then the top 64 rescored as for
  ``int4``. It reads twice the int4 copy's bytes; its tail is far closer to the dense head's
  (benchmarks/results/accuracy-vs-llamacpp.md).
"""

from __future__ import annotations

import torch

from kvcore.errors import ConfigError
from kvcore.kernels.cpu_kernels import load_kernels
from kvcore.kernels.group_quant import GroupCodes, Int8GroupLinear
from kvcore.kernels.huge_pages import HugePageArena
from kvcore.kernels.quant import A8_GROUP, Int4A8Linear, Int4Groups, Int4Linear, quantized_reasons
from kvcore.model.embedding import BlockTable

__all__ = ["LM_HEAD_FORMATS", "INT4_MAX_ROWS", "A8_MAX_ROWS", "LMHead", "RescoredInt4Head", "Int8Head", "check_lm_head",
           "int4a8_in_chunks", "int8_linear"]

#: every value of ``EngineConfig.lm_head`` with what it means
LM_HEAD_FORMATS = {
    "auto": "int4 with quantized weights where it runs, else dense (kvcore.engine.defaults)",
    "dense": "the head in the model dtype (reference)",
    "int4": "int4 scores for the whole vocabulary, the top 64 rescored with the dense head",
    "int8": "8-bit codes per group of 32 (a GGUF's Q8_0 blocks as stored), int8 activations, the top 64 rescored",
}
#: more rows than this run the dense head (see the module docstring)
INT4_MAX_ROWS = 4
A8_MAX_ROWS = 16


def check_lm_head(fmt: str, dtype: torch.dtype, device: torch.device | str) -> str:
    """``fmt`` if it is an LM head format that runs with ``dtype`` on ``device``, else ConfigError saying why."""
    if fmt not in LM_HEAD_FORMATS:
        raise ConfigError(f"unknown lm_head format '{fmt}' (choose from: {', '.join(LM_HEAD_FORMATS)})")
    reasons = []
    if fmt == "int4":  # in float32 the int4a8 kernel scores (torch's int4 kernel takes bfloat16 only)
        from kvcore.kernels.cpu_kernels import kernel_reasons

        reasons = quantized_reasons("int4a8" if dtype == torch.float32 else "int4", dtype, device) + kernel_reasons()
    elif fmt == "int8":  # the gguf format's int8-group kernel
        reasons = quantized_reasons("gguf", dtype, device)
    if reasons:
        raise ConfigError(f"lm_head '{fmt}' cannot run here: {'; '.join(reasons)}")
    return fmt


class RescoredInt4Head:
    """``hidden [N, d] -> logits [N, V]``: int4 scores, the ``top_k`` best of each row recomputed densely.

    :param weight: the dense head ``[V, d]`` (the model's own tensor: read at call time, not copied), or the model's
        :class:`~kvcore.model.embedding.BlockTable` (a tied table held as GGUF blocks): the int4 copy is made from
        its rows and the candidates' rows are decoded per call, the same values as the dense table's.
    :param int4: with ``a8``, the int4a8 copy made before (``int4a8_in_chunks(weight)``, e.g. a prepared model's).
    """

    def __init__(
        self, weight: torch.Tensor | BlockTable, top_k: int = 64, group_size: int = 32, a8: bool = False,
        int4: Int4A8Linear | None = None,
    ) -> None:
        vocab, width = weight.shape
        if not Int4Linear.fits(vocab, width, group_size):
            raise ConfigError(f"lm_head 'int4' cannot take this model's head: the int4 kernel needs a vocabulary "
                              f"in multiples of 16 and a hidden size in multiples of {group_size}, got "
                              f"[{vocab}, {width}]")
        load_kernels()
        self.weight, self.top_k = weight, min(top_k, vocab)
        # a8 (the model's weights are int4a8, or float32 activations, which torch's int4 kernel does not take): scores
        # from kvcore's int8-activation kernel, up to its row limit
        a8 = a8 or weight.dtype == torch.float32
        linear, self.max_rows = (Int4A8Linear, A8_MAX_ROWS) if a8 else (Int4Linear, INT4_MAX_ROWS)
        if a8 and group_size == 32:  # in row chunks: the head's unpacked codes never exist whole
            self.int4 = int4 if int4 is not None else int4a8_in_chunks(weight)
        else:
            self.int4 = linear(Int4Groups.from_float(weight[:], group_size, weight.dtype), weight.dtype)

    @property
    def nbytes(self) -> int:
        return self.int4.nbytes

    def __call__(self, hidden: torch.Tensor, widen: bool = False) -> torch.Tensor:
        """``[N, V]`` in the model dtype (as the dense head returns them); with ``widen``, those values as float32,
        written so by the rescoring kernel (bit for bit ``.float()`` of them, without that extra pass)."""
        hidden = hidden.contiguous()
        return rescore(self.int4(hidden), hidden, self.weight, self.top_k, widen)


def rescore(
    scores: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor | BlockTable, top_k: int, widen: bool
) -> torch.Tensor:
    """``scores [N, V]`` with each row's ``top_k`` best recomputed from ``hidden [N, d]`` and the dense rows of
    ``weight`` (a :class:`BlockTable` decodes only the candidates' rows); float32 with ``widen``."""
    ops = torch.ops.kvcore
    widen = widen and scores.dtype != torch.float32  # float32 scores are rescored in place
    if isinstance(weight, torch.Tensor):
        return (ops.rescore_top_k_float if widen else ops.rescore_top_k)(scores, hidden, weight, top_k)
    index = ops.top_k_candidates(scores, top_k)  # [N, k]
    rows = weight[index.view(-1)].view(*index.shape, -1)  # [N, k, d]: only the candidates decoded
    return (ops.rescore_candidates_float if widen else ops.rescore_candidates)(scores, hidden, rows, index)


def int4a8_in_chunks(w: torch.Tensor | BlockTable, rows: int = 1024) -> Int4A8Linear:
    """``Int4A8Linear(Int4Groups.from_float(w, 32, w.dtype), w.dtype)`` built ``rows`` output rows at a time (a
    multiple of 16), each part quantized and packed in one pass (``torch.ops.kvcore.int4a8_quantize``, bit for bit
    the same) straight into its rows (the kernel's layout is per block of 16 rows) of one huge-page arena: a big
    head's codes never exist unpacked (nor, for a :class:`BlockTable`, its dense rows whole)."""
    n, k = w.shape
    if not Int4A8Linear.fits(n, k, A8_GROUP):
        raise ValueError(f"int4a8 kernel cannot take a [{n}, {k}] weight in groups of {A8_GROUP}")
    load_kernels()
    shapes = [((n // 16, k // A8_GROUP, 256), torch.uint8), ((n // 16, k // A8_GROUP, 2, 16), torch.float16)]
    arena = HugePageArena(HugePageArena.bytes_for(shapes))  # each decode step streams the whole head
    codes, dm = (arena.empty(*s) for s in shapes)
    for a in range(0, n, rows):
        part = slice(a // 16, (a + rows) // 16)
        torch.ops.kvcore.int4a8_quantize(w[a : a + rows].contiguous(), codes[part], dm[part])
    return Int4A8Linear.from_layout(codes, dm, w.dtype)


class Int8Head:
    """``hidden [N, d] -> logits [N, V]`` from the head's 8-bit codes in groups of 32 (``lm_head = "int8"``).

    :param weight: the dense head ``[V, d]``, or the model's :class:`~kvcore.model.embedding.BlockTable`.
    :param linear: the head's :func:`int8_linear` made before (a prepared model's), else made here.
    Each row's ``top_k`` best are then rescored with the dense rows.
    """

    max_rows = A8_MAX_ROWS  # more rows run the dense head, as the int4a8 head does

    def __init__(self, weight: torch.Tensor | BlockTable, top_k: int = 64, linear: Int8GroupLinear | None = None):
        vocab, width = weight.shape
        if not Int8GroupLinear.fits(vocab, width, 32):
            raise ConfigError(f"lm_head 'int8' cannot take this model's head: the int8-group kernel needs a vocabulary "
                              f"in multiples of 16 and a hidden size in multiples of 32, got [{vocab}, {width}]")
        self.linear = linear if linear is not None else int8_linear(weight)
        self.weight, self.top_k = weight, min(top_k, vocab)

    @property
    def nbytes(self) -> int:
        return self.linear.nbytes

    def __call__(self, hidden: torch.Tensor, widen: bool = False) -> torch.Tensor:
        """``[N, V]`` in the model dtype (float32 with ``widen``)."""
        hidden = hidden.contiguous()
        return rescore(self.linear(hidden), hidden, self.weight, self.top_k, widen)


def int8_linear(w: torch.Tensor | BlockTable) -> Int8GroupLinear:
    """The head ``w`` as 8-bit codes per group of 32 on the int8-group kernel: a :class:`BlockTable` whose blocks have
    8-bit codes (Q8_0) as stored; a dense head quantized per group of 32 columns with ``d = max|w| / 127`` (Q8_0's
    rule)."""
    blocks = getattr(w, "blocks", None)
    codes = blocks.codes() if blocks is not None and hasattr(blocks, "codes") else None
    if codes is None or codes.bits > 8 or codes.group_size % 32:
        codes = q8_codes(w[:])
    load_kernels()
    return Int8GroupLinear(codes.regroup(32), w.dtype)


def q8_codes(w: torch.Tensor) -> GroupCodes:
    """``w [N, K]`` as Q8_0 does it: per group of 32, ``d = max|w| / 127``, ``q = round(w / d) + 128`` (unsigned, so
    ``m = -128 d``)."""
    n, k = w.shape
    g = w.float().view(n, k // 32, 32)
    d = g.abs().amax(-1) / 127
    q = torch.where(d[..., None] > 0, g / d[..., None], torch.zeros_like(g)).round().clamp(-127, 127) + 128
    return GroupCodes(q.to(torch.uint8).view(n, k), d, -128 * d, 8)


#: a packed LM head format (None in its place: the dense head)
LMHead = RescoredInt4Head | Int8Head
