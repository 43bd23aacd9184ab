"""One forward call: bind a backend to its cache and plan, run the model, compute the last rows' logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore.attention import AttentionBackend, AttentionMetadata
from kvcore.backend_check import BackendGuard
from kvcore.compile import CompiledDecode
from kvcore.kv_cache import KVCache
from kvcore.model import LlamaModel

__all__ = ["run_model", "last_token_logits"]


def run_model(
    model: LlamaModel,
    backend: AttentionBackend,
    cache: KVCache,
    meta: AttentionMetadata,
    input_ids: Sequence[int] | torch.Tensor,
    check=None,
    compiled: CompiledDecode | None = None,
) -> torch.Tensor:
    """``[T, d]`` hidden states of the packed tokens ``input_ids``; their K/V land in ``cache``.

    The backend's plan is made once here, before the first layer, and shared by every layer. ``check`` (a
    :meth:`BackendGuard.begin` result) sees every layer's attention output (layer 0's only when a decode
    batch runs ``compiled``: the traced code has no Python between layers).
    """
    plan = backend.plan(meta, cache)
    ids = torch.as_tensor(input_ids, dtype=torch.long).to(meta.positions.device)
    matmuls = None
    if compiled is not None and meta.is_decode:
        out = compiled(model, backend, cache, plan, ids, meta.positions)
        if out is not None:  # None: compiling failed, this step runs eagerly
            hidden, q0, out0 = out
            if check is not None:
                check.observe(0, q0, out0)
            return hidden
    elif compiled is not None:
        matmuls = compiled.prefill_matmuls(model, ids.shape[0])

    def attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = backend.forward(layer_idx, q, k, v, cache, plan)
        if check is not None:
            check.observe(layer_idx, q, out)
        return out

    return model(ids, meta.positions, attention, matmuls)


def last_token_logits(
    model: LlamaModel,
    backend: AttentionBackend,
    cache: KVCache,
    meta: AttentionMetadata,
    input_ids: Sequence[int] | torch.Tensor,
    rows: Sequence[int] | None = None,
    guard: BackendGuard | None = None,
    compiled: CompiledDecode | None = None,
    head=None,
) -> torch.Tensor:
    """``[B, V]`` float32 logits of each sequence's last packed token (what the sampler picks from); with
    ``rows``, ``[len(rows), V]`` of those sequences only (a partly prefilled sequence needs none). With
    ``compiled``, decode batches run through it (:mod:`kvcore.compile`); ``head`` is the LM head format's
    callable (:mod:`kvcore.lm_head`; None: dense).

    With ``guard``, the backend's outputs are checked (:mod:`kvcore.backend_check`): a broken output raises
    :class:`~kvcore.errors.BackendOutputError` instead of becoming wrong tokens
    (:class:`~kvcore.errors.NonFiniteRowsError` when only some sequences are not finite).
    """
    check = guard.begin(meta, cache) if guard is not None else None
    hidden = run_model(model, backend, cache, meta, input_ids, check, compiled)
    last_rows = (meta.cu_seqlens_q[1:] - 1).long()
    if rows is not None:
        last_rows = last_rows[torch.as_tensor(rows, dtype=torch.long, device=last_rows.device)]
    logits = model.compute_logits(hidden[last_rows], head)
    if check is not None:
        check.finish(logits, list(rows) if rows is not None else None)
    return logits
