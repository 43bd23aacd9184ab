"""A quantized model's token table held as the file stores it: GGUF blocks, rows decoded when they are read.

A GGUF's embedding is usually Q8_0 (or another block type); dequantized whole in bfloat16 it would take about twice
its stored bytes, and a tied table is also the LM head. :class:`BlockTable` keeps the blocks (in the model file, read
row by row, where the loader gives them as a range of it: :meth:`~kvcore.loaders.gguf_blocks.GGUFBlocks.lookup_table`)
and decodes only the rows a forward gathers (the embedding lookup) and the candidates the int4 head rescores
(:class:`~kvcore.model.lm_head.RescoredInt4Head`), each exactly as the whole table would be dequantized (llama.cpp's
reference values rounded once to the model dtype), so the logits are the same. What needs the whole table (a dense
LM head: more logit rows than the int4 head takes, or ``lm_head`` dense) gets it once, from :func:`dense_embedding`,
and the blocks go: the model then holds the dense table only, as a model loaded without blocks does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["BlockTable", "hold_blocks", "dense_embedding", "eager_under_compile", "head_rows"]

#: the canonical name of the token table
EMBEDDING = "model.embed_tokens.weight"


class BlockTable:
    """``[V, d]`` rows of ``blocks`` (a :class:`~kvcore.loaders.gguf_blocks.GGUFBlocks` lookup table, or anything with
    ``shape``, ``nbytes``, ``rows(index, dtype)`` and ``dequantize_into(out)``) in ``dtype``.

    ``table(ids)`` is ``F.embedding(ids, W)`` and ``table[index]`` is ``W[index]`` for the dense ``W`` the blocks
    dequantize to; :meth:`dense` makes ``W`` and from then on serves every read from it."""

    def __init__(self, blocks: Any, dtype: torch.dtype) -> None:
        self.blocks, self.dtype, self.shape = blocks, dtype, tuple(blocks.shape)
        self._dense: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self._dense.nbytes if self._dense is not None else self.blocks.nbytes

    def __getitem__(self, index: torch.Tensor | slice) -> torch.Tensor:
        """Rows ``index`` (``[n]`` int64 or a slice of rows): ``[n, d]``."""
        if self._dense is not None:
            return self._dense[index]
        return self.blocks.rows(index, self.dtype)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding lookup: ``ids`` ``[T]`` int64 -> ``[T, d]`` (eager under torch.compile once
        :func:`eager_under_compile` ran)."""
        return self[ids]

    def dense(self) -> torch.Tensor:
        """The whole table ``[V, d]``, made once; the blocks are let go."""
        if self._dense is None:
            out = torch.empty(self.shape, dtype=self.dtype)
            self.blocks.dequantize_into(out)
            self._dense, self.blocks = out, None
        return self._dense


def eager_under_compile() -> None:
    """Make :class:`BlockTable` lookups run eagerly inside ``torch.compile``'d code (a compiled decode step breaks
    its graph there): Inductor warns about, and may fuse differently, the float16 scales decoded next to bfloat16
    rows. The compiled decode path calls it before it compiles; marking the method at import instead would import
    torch's compiler, a second of every start, for runs that never compile."""
    if not getattr(BlockTable.__call__, "_kvcore_eager", False):
        BlockTable.__call__ = torch.compiler.disable(BlockTable.__call__)
        BlockTable.__call__._kvcore_eager = True


def hold_blocks(model: nn.Module, weights: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """Give ``model`` its token table as blocks (``model.embedding``; ``model.embed_tokens`` left empty) when
    ``weights`` has it as GGUF blocks (read from the file per lookup where they are a range of it, else held);
    returns the weights still to copy into the model."""
    value = weights.get(EMBEDDING)
    if not hasattr(value, "lookup_table"):  # a float checkpoint, or a float GGUF tensor: the dense table
        return weights
    model.embedding = BlockTable(value.lookup_table(), dtype)
    model.embed_tokens.data = torch.empty(0, value.shape[1], dtype=dtype)
    return {n: v for n, v in weights.items() if n != EMBEDDING}


def dense_embedding(model: nn.Module) -> None:
    """Make a model whose tied head is held as blocks hold the dense table instead (its dense head needs it)."""
    if model.embedding is not None and model.lm_head is model.embed_tokens:
        model.embed_tokens.data = model.embedding.dense()
        model.embedding = None


def head_rows(model: nn.Module) -> torch.Tensor | BlockTable:
    """The LM head ``[V, d]``: the dense tensor, or the :class:`BlockTable` when the tied table is held as blocks."""
    table = getattr(model, "embedding", None)
    return table if table is not None and model.lm_head is model.embed_tokens else model.lm_head
