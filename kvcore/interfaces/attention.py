"""The attention-backend interface: declared capabilities, the per-layer forward, the causal mask.

The packed layout every backend receives is described in :mod:`kvcore.interfaces.metadata`.

How each decoder layer attends is its :class:`~kvcore.interfaces.layer_attention.LayerAttention` (the scale,
and the variants beyond plain causal attention: a sliding window, logit soft-capping, attention sinks). The
model declares one per layer, the metadata carries them
(:meth:`~kvcore.interfaces.metadata.AttentionMetadata.layer`), and a backend declares the variants it serves
per phase in :class:`BackendCapabilities` (see docs/attention-variants.md).
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch

from kvcore.interfaces.decode_stack import DecodeStack
from kvcore.interfaces.kv_cache import KVCache, placement_reasons
from kvcore.interfaces.layer_attention import VARIANTS, LayerAttention
from kvcore.interfaces.metadata import AttentionMetadata
from kvcore.interfaces.options import unknown_options_error
from kvcore.interfaces.variants import apply_mods

from .dtypes import dtype_name

__all__ = ["BackendCapabilities", "AttentionBackend", "causal_mask", "explicit_attention"]

#: a backend's own per-call plan type (``AttentionMetadata`` itself when it needs nothing more)
PlanT = TypeVar("PlanT")


def causal_mask(
    context_len: int, query_len: int, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """``[query_len, context_len + query_len]`` bool, True where attention is allowed: the causal mask
    aligned bottom-right, query ``i`` sitting at absolute position ``context_len + i`` and seeing keys
    ``0 .. context_len + i``. With ``context_len == 0`` it is the ordinary lower-triangular mask. With a
    sliding ``window``, only the last ``window`` of those keys (the query's own included)."""
    query_pos = torch.arange(context_len, context_len + query_len, device=device)[:, None]
    key_pos = torch.arange(context_len + query_len, device=device)[None, :]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    return allowed


def explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, layer: LayerAttention,
    at: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Attention with every :class:`LayerAttention` variant, spelled out in float32 for backends whose fused
    kernel lacks one (soft-capping and sinks have no ``scaled_dot_product_attention`` argument).

    :param q: ``[B, H, n, D]``; ``k``, ``v``: ``[B, H_kv, S, D]`` (``H % H_kv == 0``).
    :param mask: broadcastable to ``[B, H, n, S]``: bool (True = visible) or additive float; None: all visible.
    :param at: for a layer with registered variants (``layer.mods``; then ``B == 1`` and a bool or no mask):
        ``(b, context_len)``, the sequence's row in its call and the position of query 0 (keys at 0 .. S-1).
    :returns: ``[B, H, n, D]`` in ``q``'s dtype.
    """
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # (B, H, S, D)
    v = v.float().repeat_interleave(group, dim=1)
    scores = q.float() @ k.transpose(-2, -1) * layer.scale  # (B, H, n, S)
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    if layer.mods:
        if at is None or q.shape[0] != 1 or (mask is not None and mask.dtype != torch.bool):
            raise ValueError("a layer with registered variants needs one sequence, a bool mask and at=(b, context_len)")
        (b, ctx), (n, S), device = at, scores.shape[-2:], q.device
        mask = torch.ones((n, S), dtype=torch.bool, device=device) if mask is None else mask
        h = torch.arange(q.shape[1], device=device)[:, None, None]  # the index shapes naive uses
        q_idx, kv_idx = torch.arange(ctx, ctx + n, device=device)[None, :, None], torch.arange(S, device=device)
        scores, mask = apply_mods(layer.mods, scores, mask, torch.tensor(b, device=device), h, q_idx,
                                  kv_idx[None, None, :])
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask.float()
    if layer.sinks is None:
        return (scores.softmax(dim=-1) @ v).to(q.dtype)
    sink = layer.sinks.float().to(q.device).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # (B, H, n, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]  # the sink weights no value
    return (probs @ v).to(q.dtype)


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do. ``kvcore backends`` renders its table from these declarations."""

    devices: frozenset[str]  # torch device types, e.g. {"cpu", "cuda"}
    dtypes: frozenset[torch.dtype]  # model dtypes it computes in (q, k, v and its output)
    kv_layouts: tuple[str, ...]  # KV-cache layouts it reads, preferred first ("contiguous", "paged")
    head_dims: frozenset[int] | None = None  # None: any head size
    max_head_dim: int | None = None  # largest head size D it serves (None: no limit)
    head_dim_multiple: int | None = None  # e.g. 8: kernels that vectorise over head_dim
    supports_gqa: bool = True  # H_kv < H (grouped-query / multi-query attention)
    supports_prefill: bool = True  # it serves calls with prompt rows (query_len > 1 or context 0)
    supports_decode: bool = True  # it serves decode steps (one query row per sequence after its cache)
    min_compute_capability: tuple[int, int] | None = None  # CUDA only, e.g. (8, 0) for sm80
    #: CUDA only: dtypes served on part of the compute-capability range alone, as ``(dtype, lowest,
    #: highest)`` (both inclusive; ``None``: no upper limit), e.g. a dtype only one kernel family has
    dtype_compute_capability: tuple[tuple[torch.dtype, tuple[int, int], tuple[int, int] | None], ...] = ()
    #: its decode ``forward`` can be traced by ``torch.compile`` (``EngineConfig.compile``): tensor ops only,
    #: no host syncs, reads only the plan's tensors and ints, writes the cache only through whole cache
    #: tensors, never views of them (see kvcore/execution/compile.py)
    compilable: bool = False
    #: the :data:`VARIANTS` (``"sliding_window"``, ``"softcap"``, ``"sinks"``) its prefill calls
    #: implement; a layer using another is refused with :meth:`reasons_variants`, never run wrong
    prefill_variants: frozenset[str] = frozenset()
    #: the same for its decode steps
    decode_variants: frozenset[str] = frozenset()
    #: it evaluates any registered variant's ``score_mod`` / ``mask_mod`` (:mod:`kvcore.interfaces.variants`) in
    #: both phases; a backend without it serves only the registered names its variant sets list (natively)
    variants_as_code: bool = False
    #: its forward takes rows of several query tokens after a cached context in a step of running requests
    #: (speculative verification: a decode step whose rows score the draft tokens too, causal among them)
    multi_token_decode: bool = False
    #: :meth:`AttentionBackend.decode_stack` hands the attention of some calls to a native decode stack
    #: (:mod:`kvcore.interfaces.decode_stack`)
    decode_stack: bool = False

    def variants(self, phase: str) -> frozenset[str]:
        """The variants of ``phase`` ("prefill" or "decode")."""
        return self.prefill_variants if phase == "prefill" else self.decode_variants

    def reasons_variants(self, needed: Collection[str], phases: Sequence[str] = ("prefill", "decode")) -> list[str]:
        """Human reasons ("decode: no soft-capping") why the ``needed`` variants are not all served in
        ``phases`` ([] = fine)."""
        reasons = []
        for phase in phases:
            missing = sorted(set(needed) - self.variants(phase) - self._registered(needed))
            if missing:
                named = [VARIANTS.get(m, f"variant '{m}'") for m in missing]
                reasons.append(f"{phase}: no {', no '.join(named)}")
        return reasons

    def _registered(self, needed: Collection[str]) -> set[str]:
        """The registered (not built-in) names among ``needed`` that ``variants_as_code`` covers."""
        return {n for n in needed if n not in VARIANTS} if self.variants_as_code else set()

    def reasons_unsupported(
        self, *, device: torch.device, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int
    ) -> list[str]:
        """Human reasons why this configuration is outside the declared capabilities ([] = fine)."""
        reasons = placement_reasons(self.devices, self.dtypes, device=device, dtype=dtype)
        if self.head_dims is not None and head_dim not in self.head_dims:
            reasons.append(f"head_dim {head_dim} not supported (supports: {sorted(self.head_dims)})")
        if self.max_head_dim is not None and head_dim > self.max_head_dim:
            reasons.append(f"head_dim {head_dim} exceeds the maximum {self.max_head_dim}")
        if self.head_dim_multiple and head_dim % self.head_dim_multiple:
            reasons.append(f"head_dim {head_dim} is not a multiple of {self.head_dim_multiple}")
        if num_heads % num_kv_heads:
            reasons.append(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        elif num_kv_heads != num_heads and not self.supports_gqa:
            reasons.append(f"grouped-query attention ({num_heads} query / {num_kv_heads} KV heads) not supported")
        if device.type == "cuda" and torch.cuda.is_available():
            have = torch.cuda.get_device_capability(device)
            if self.min_compute_capability and have < self.min_compute_capability:
                need = ".".join(map(str, self.min_compute_capability))
                reasons.append(f"GPU compute capability {have[0]}.{have[1]} < {need}")
            if dtype in self.dtypes and dtype not in self.dtypes_on(have):
                reasons.append(f"dtype {dtype_name(dtype)} is not served on compute capability "
                               f"{have[0]}.{have[1]} ({self.dtype_range(dtype)})")
        return reasons

    def dtypes_on(self, compute_capability: tuple[int, int]) -> frozenset[torch.dtype]:
        """The declared dtypes a CUDA GPU of ``compute_capability`` is served in."""
        ranges = {d: (low, high) for d, low, high in self.dtype_compute_capability}
        return frozenset(
            d for d in self.dtypes
            if d not in ranges or (ranges[d][0] <= compute_capability and
                                   (ranges[d][1] is None or compute_capability <= ranges[d][1]))
        )

    def dtype_range(self, dtype: torch.dtype) -> str:
        """``"sm60-sm90"`` / ``"sm80+"``: where ``dtype`` is served ("any" when it has no range)."""
        for d, low, high in self.dtype_compute_capability:
            if d == dtype:
                return f"sm{low[0]}{low[1]}" + (f"-sm{high[0]}{high[1]}" if high else "+")
        return "any"


class AttentionBackend(abc.ABC, Generic[PlanT]):
    """An attention implementation. Subclass it, declare ``name`` and ``capabilities``, implement
    :meth:`forward` (and :meth:`plan` when per-call work can be shared by the layers), and register the
    class through the ``kvcore_register_backends`` hook.

    A backend instance is stateless across calls; all per-sequence state lives in the
    :class:`~kvcore.interfaces.kv_cache.KVCache` it is handed, all per-call state in the plan.
    """

    name: ClassVar[str]  # what --backend / backend = "..." select it by; unique among registered backends
    capabilities: ClassVar[BackendCapabilities]  # its declarations (above)
    description: ClassVar[str] = ""  # one line for `kvcore backends`
    #: higher wins when kvcore picks a backend automatically among the available ones
    priority: ClassVar[int] = 0

    def __init__(self, **options: Any) -> None:
        """``options`` come from the ``[backends.<name>]`` table of the config file."""
        if options:
            raise unknown_options_error("backend", self.name, "backends", type(self), options)

    @classmethod
    def availability(cls) -> str | None:
        """``None`` when the backend can run on this machine, else a one-line human reason
        (package missing, no CUDA device, compute capability too old...). Must not raise."""
        return None

    def validate(
        self, *, device: torch.device, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int
    ) -> list[str]:
        """All reasons this backend cannot serve that model configuration ([] = it can)."""
        reason = self.availability()
        reasons = [reason] if reason else []
        return reasons + self.capabilities.reasons_unsupported(
            device=device, dtype=dtype, head_dim=head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads
        )

    def plan(self, meta: AttentionMetadata, cache: KVCache) -> PlanT:
        """Turn the call's metadata into this backend's own typed plan, once per forward call (before the
        first layer); every layer's :meth:`forward` receives it. The default plan is ``meta`` itself; a
        backend with work its layers share (gather indices, masks) declares ``AttentionBackend[MyPlan]``
        and returns a dataclass holding ``meta`` and that work."""
        return meta  # type: ignore[return-value]

    def decode_stack(self, plan: PlanT, cache: KVCache) -> DecodeStack | None:
        """The attention of every layer of this call as a :class:`DecodeStack`, when the backend would run each
        layer as ``cached_decode_attention`` calls (declare ``capabilities.decode_stack``); None: the model calls
        :meth:`forward` per layer. The operator then writes the cache and attends as those calls would."""
        return None

    def decode_stack_reason(self) -> str | None:
        """One line saying why :meth:`decode_stack` never hands over a call's attention; None: it does for the
        calls it describes. The default follows ``capabilities.decode_stack``; a backend with a switch of its own
        names it here, so generic code never reads a backend's internals."""
        if self.capabilities.decode_stack:
            return None
        return f"backend '{self.name}' does not describe its attention as a native stack (capabilities.decode_stack)"

    @abc.abstractmethod
    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        plan: PlanT,
    ) -> torch.Tensor:
        """Write this call's K/V into ``cache`` (``cache.write``), then attend as the layer's
        :class:`LayerAttention` (``meta.layer(layer_idx)``) says: a backend is only handed layers whose
        variants its capabilities declare for the call's phase.

        :param layer_idx: decoder layer, selects the cache layer and the layer's attention spec.
        :param q: ``[T, H, D]`` queries, RoPE already applied.
        :param k: ``[T, H_kv, D]`` new keys, RoPE already applied.
        :param v: ``[T, H_kv, D]`` new values.
        :param cache: the KV cache; its ``layout`` is one of ``capabilities.kv_layouts``.
        :param plan: what :meth:`plan` returned for this call.
        :returns: ``[T, H, D]`` attention output, same dtype as ``q``.
        """
