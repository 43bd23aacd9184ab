"""One forward call: bind a backend to its cache and plan, run the model, compute the last rows' logits.

:class:`ModelRunner` runs it in this process; :class:`~kvcore.execution.distributed.TensorParallelRunner`
runs it on every rank of a group. Both are an :class:`Executor`, the one seam the engine step calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from kvcore.execution.backend_check import BackendGuard
from kvcore.execution.compile import CompiledDecode
from kvcore.interfaces.attention import AttentionBackend
from kvcore.interfaces.kv_cache import KVCache
from kvcore.interfaces.metadata import AttentionMetadata
from kvcore.model.decoder import LlamaModel
from kvcore.model.fused_layer import fused_layer_reasons

__all__ = ["Executor", "ModelRunner", "RunConfig", "decode_stack_reasons", "run_model", "last_token_logits",
           "position_logits"]


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

    The backend's plan is made once here, before the first layer, and shared by every layer (one per group of
    layers with their own block tables, :meth:`AttentionMetadata.for_layer`). ``check`` (a
    :meth:`BackendGuard.begin` result) sees every layer's attention output (layer 0's only when a decode
    batch runs ``compiled``: the traced code has no Python between layers).
    """
    cache.before_forward(meta)
    plans = tuple(backend.plan(m, cache) for m in meta.group_metas)
    ids = torch.as_tensor(input_ids, dtype=torch.long).to(meta.positions.device)
    matmuls = None
    if compiled is not None and meta.is_decode:
        out = compiled(model, backend, cache, plans, meta.layer_groups, ids, meta.positions)
        if out is not None:  # None: compiling failed, this step runs eagerly
            hidden, q0, out0 = out
            if check is not None:
                check.observe(0, q0, out0)
            return hidden
    elif compiled is not None:
        matmuls = compiled.prefill_matmuls(model, ids.shape[0])

    layer_plans = [plans[g] for g in meta.layer_groups] if meta.layer_groups else None
    forward, plan0 = backend.forward, plans[0]

    def attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = forward(layer_idx, q, k, v, cache, layer_plans[layer_idx] if layer_plans else plan0)
        if check is not None:
            check.observe(layer_idx, q, out)
        return out

    # every layer's attention as data for the fused layers' native stack (the model's first layer still calls
    # attention, so a check observes layer 0); one plan only: layer groups read their own block tables
    stack = None
    if model.fused_layers and backend.capabilities.decode_stack and len(plans) == 1:
        stack = backend.decode_stack(plan0, cache)
    return model(ids, meta.positions, attention, matmuls, stack)


def decode_stack_reasons(model: LlamaModel, backend: AttentionBackend) -> list[str]:
    """Why no forward of ``model`` on ``backend`` runs layers 1.. as one native call
    (:mod:`kvcore.interfaces.decode_stack`); [] = the calls the backend describes do (for ``cpu_decode``: decode
    batches and short rows after a cache on a bfloat16 or float32 cache, every layer without attention sinks)."""
    reasons = []
    if not model.fused_layers:
        reasons += fused_layer_reasons(model) or ["the model's fused layers are switched off"]
    reason = backend.decode_stack_reason()
    return reasons + ([reason] if reason else [])


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
    ``compiled``, decode batches run through it (:mod:`kvcore.execution.compile`); ``head`` is the LM head format's
    callable (:mod:`kvcore.model.lm_head`; None: dense).

    With ``guard``, the backend's outputs are checked (:mod:`kvcore.execution.backend_check`): a broken output raises
    :class:`~kvcore.errors.BackendOutputError` instead of becoming wrong tokens
    (:class:`~kvcore.errors.NonFiniteRowsError` when only some sequences are not finite).
    """
    check = guard.begin(meta, cache) if guard is not None else None
    hidden = run_model(model, backend, cache, meta, input_ids, check, compiled)
    ends = meta.query_starts[1:]  # host lists: no device work to pick the rows
    last_rows = [ends[i] - 1 for i in rows] if rows is not None else [e - 1 for e in ends]
    if last_rows != list(range(hidden.shape[0])):  # a decode batch samples every row: hidden as it is
        hidden = hidden[torch.tensor(last_rows, dtype=torch.long, device=hidden.device)]
    logits = model.compute_logits(hidden, head)
    if check is not None:
        check.finish(logits, list(rows) if rows is not None else None)
    return logits


def position_logits(
    model: LlamaModel,
    backend: AttentionBackend,
    cache: KVCache,
    meta: AttentionMetadata,
    input_ids: Sequence[int] | torch.Tensor,
    rows: Sequence[int],
    num_positions: Sequence[int],
    guard: BackendGuard | None = None,
    head=None,
) -> torch.Tensor:
    """``[sum(num_positions), V]`` float32 logits of the last ``num_positions[j]`` packed tokens of sequence
    ``rows[j]``, in order: what speculative verification scores (every draft position of a row, and the
    position after its last draft). Runs eagerly (a compiled decode step has one query per sequence)."""
    check = guard.begin(meta, cache) if guard is not None else None
    hidden = run_model(model, backend, cache, meta, input_ids, check)
    starts = meta.query_starts
    picked = [p for i, m in zip(rows, num_positions) for p in range(starts[i + 1] - m, starts[i + 1])]
    picked_hidden = hidden[torch.tensor(picked, dtype=torch.long, device=hidden.device)]
    # the head a one-token step of these rows runs (decided by the number of sequences), so that each position's
    # logits are that step's bit for bit: the int4 head in parts of at most head.max_rows positions
    if head is None or len(rows) > head.max_rows:
        logits = model.compute_logits(picked_hidden)
    else:
        parts = [model.compute_logits(part, head) for part in picked_hidden.split(head.max_rows)]
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
    if check is not None:
        check.finish(logits, [i for i, m in zip(rows, num_positions) for _ in range(m)])
    return logits


class RunConfig(Protocol):
    """What an executor reads of the engine's configuration (an :class:`~kvcore.engine.config.EngineConfig`)."""

    @property
    def device(self) -> str: ...

    @property
    def tensor_parallel_size(self) -> int: ...

    @property
    def backend_options(self) -> dict[str, dict[str, Any]]: ...  # per backend name: its constructor options

    @property
    def kv_cache_options(self) -> dict[str, dict[str, Any]]: ...  # per KV cache name: its constructor options


class Executor(Protocol):
    """Runs one scheduled forward wherever the model lives."""

    def start(self, prefill_backend: AttentionBackend, decode_backend: AttentionBackend, cache: KVCache,
              config: RunConfig) -> None:
        """Called once the engine has its backends and cache, before the first step."""

    def forward(self, is_prefill: bool, backend: AttentionBackend, cache: KVCache, meta: AttentionMetadata,
                input_ids: Sequence[int], copies: Sequence[tuple[int, int]] = (),
                rows: Sequence[int] | None = None) -> torch.Tensor:
        """``[B, V]`` float32 logits of each sequence's last token, or of the sequences ``rows`` only;
        ``copies``: the copy-on-write block copies this step's metadata already applied to ``cache``."""

    def forward_positions(self, backend: AttentionBackend, cache: KVCache, meta: AttentionMetadata,
                          input_ids: Sequence[int], rows: Sequence[int], num_positions: Sequence[int],
                          copies: Sequence[tuple[int, int]] = ()) -> torch.Tensor:
        """``[sum(num_positions), V]`` float32 logits of the last ``num_positions[j]`` tokens of sequence
        ``rows[j]`` (:func:`position_logits`: what speculative verification scores), on the decode path;
        ``copies`` as for :meth:`forward`."""

    def describe(self) -> dict[str, Any] | None:
        """What each process of the group runs (None: one process)."""

    def failure(self) -> str | None:
        """Why the executor can no longer run a step (a rank has ended), or None. Cheap; any thread."""

    def close(self) -> None:
        """Release what :meth:`start` took (processes, process groups)."""


class ModelRunner:
    """The :class:`Executor` of a one-process engine: the model here, each backend's output guard, the
    compiled decode steps and the LM head format."""

    def __init__(self, model: LlamaModel, guards: dict[int, BackendGuard] | None = None,
                 compiled: CompiledDecode | None = None, head=None) -> None:
        self.model = model
        self.guards = guards or {}  #: id(backend) -> its BackendGuard
        self.compiled = compiled
        self.head = head

    def start(self, prefill_backend, decode_backend, cache, config) -> None:
        return None

    def forward(self, is_prefill, backend, cache, meta, input_ids, copies=(), rows=None) -> torch.Tensor:
        guard = self.guards.get(id(backend))
        return last_token_logits(self.model, backend, cache, meta, input_ids, rows, guard, self.compiled, self.head)

    def forward_positions(self, backend, cache, meta, input_ids, rows, num_positions, copies=()) -> torch.Tensor:
        guard = self.guards.get(id(backend))
        return position_logits(self.model, backend, cache, meta, input_ids, rows, num_positions, guard, self.head)

    def describe(self) -> None:
        return None

    def failure(self) -> None:
        return None  # this process is the executor: if it runs, it can step

    def close(self) -> None:
        return None
