"""The attention-backend interface: declared capabilities, the per-layer forward, the causal mask.

The packed layout every backend receives is described in :mod:`kvcore.interfaces.metadata`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch

from kvcore.errors import ConfigError
from kvcore.interfaces.kv_cache import KVCache
from kvcore.interfaces.metadata import AttentionMetadata

__all__ = ["BackendCapabilities", "AttentionBackend", "causal_mask"]

#: a backend's own per-call plan type (``AttentionMetadata`` itself when it needs nothing more)
PlanT = TypeVar("PlanT")


def causal_mask(context_len: int, query_len: int, device: torch.device) -> torch.Tensor:
    """``[query_len, context_len + query_len]`` bool, True where attention is allowed: the causal mask
    aligned bottom-right, query ``i`` sitting at absolute position ``context_len + i`` and seeing keys
    ``0 .. context_len + i``. With ``context_len == 0`` it is the ordinary lower-triangular mask."""
    query_pos = torch.arange(context_len, context_len + query_len, device=device)[:, None]
    return torch.arange(context_len + query_len, device=device)[None, :] <= query_pos


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do. ``kvcore backends`` renders its table from these declarations."""

    devices: frozenset[str]  # torch device types, e.g. {"cpu", "cuda"}
    dtypes: frozenset[torch.dtype]
    kv_layouts: tuple[str, ...]  # KV-cache layouts it reads, preferred first ("contiguous", "paged")
    head_dims: frozenset[int] | None = None  # None: any head size
    max_head_dim: int | None = None
    head_dim_multiple: int | None = None  # e.g. 8: kernels that vectorise over head_dim
    supports_gqa: bool = True  # H_kv < H (grouped-query / multi-query attention)
    supports_prefill: bool = True
    supports_decode: bool = True
    min_compute_capability: tuple[int, int] | None = None  # CUDA only, e.g. (8, 0) for sm80
    #: CUDA only: dtypes served on part of the compute-capability range alone, as ``(dtype, lowest,
    #: highest)`` (both inclusive; ``None``: no upper limit), e.g. a dtype only one kernel family has
    dtype_compute_capability: tuple[tuple[torch.dtype, tuple[int, int], tuple[int, int] | None], ...] = ()
    #: its decode ``forward`` can be traced by ``torch.compile`` (``EngineConfig.compile``): tensor ops only,
    #: no host syncs, reads only the plan's tensors and ints, writes the cache only through whole cache
    #: tensors, never views of them (see kvcore/execution/compile.py)
    compilable: bool = False

    def reasons_unsupported(
        self, *, device: torch.device, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int
    ) -> list[str]:
        """Human reasons why this configuration is outside the declared capabilities ([] = fine)."""
        reasons = []
        if device.type not in self.devices:
            reasons.append(f"device '{device.type}' not supported (supports: {', '.join(sorted(self.devices))})")
        if dtype not in self.dtypes:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.dtypes))
            reasons.append(f"dtype {str(dtype).removeprefix('torch.')} not supported (supports: {names})")
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
                reasons.append(f"dtype {str(dtype).removeprefix('torch.')} is not served on compute capability "
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

    name: ClassVar[str]
    capabilities: ClassVar[BackendCapabilities]
    description: ClassVar[str] = ""
    #: higher wins when kvcore picks a backend automatically among the available ones
    priority: ClassVar[int] = 0

    def __init__(self, **options: Any) -> None:
        """``options`` come from the ``[backends.<name>]`` table of the config file."""
        if options:
            raise ConfigError(f"backend '{self.name}' got unknown options: {', '.join(sorted(options))}")

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
        """Write this call's K/V into ``cache`` (``cache.write``), then attend.

        :param layer_idx: decoder layer, selects the cache layer.
        :param q: ``[T, H, D]`` queries, RoPE already applied.
        :param k: ``[T, H_kv, D]`` new keys, RoPE already applied.
        :param v: ``[T, H_kv, D]`` new values.
        :param cache: the KV cache; its ``layout`` is one of ``capabilities.kv_layouts``.
        :param plan: what :meth:`plan` returned for this call.
        :returns: ``[T, H, D]`` attention output, same dtype as ``q``.
        """
