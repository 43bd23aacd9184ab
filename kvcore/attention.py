"""The attention-backend interface and the per-call metadata every backend receives.

Tokens of all sequences in one forward call are *packed* along a single axis (vLLM / flash-attn
"varlen" layout): for B sequences with ``query_lens = [q_0, ..., q_{B-1}]`` the model's tensors have
``T = sum(query_lens)`` rows. One call therefore serves

* prefill: ``context_len = 0``, ``query_len = prompt length``, causal mask;
* decode: ``query_len = 1``, attends to the whole cache with no mask;
* a prefill that continues an existing cache: ``context_len > 0``, ``query_len > 1``; the causal mask is
  aligned bottom-right, i.e. query row ``i`` sits at absolute position ``context_len + i``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from kvcore.kv_cache import CacheSpec, KVCache

__all__ = ["AttentionMetadata", "BackendCapabilities", "AttentionBackend"]


@dataclass
class AttentionMetadata:
    """Describes one forward call over a packed batch of ``B`` sequences.

    Python lists mirror the small integer tensors so backends can shape work without a device sync.
    """

    seq_ids: list[int]  # cache-level sequence ids, length B
    query_lens: list[int]  # new tokens per sequence, length B
    context_lens: list[int]  # tokens already cached before this call, length B
    positions: torch.Tensor  # [T] int64, absolute position of every packed query token
    cu_seqlens_q: torch.Tensor  # [B + 1] int32, prefix sums of query_lens (row offsets into T)
    seq_lens_t: torch.Tensor  # [B] int32, context_len + query_len per sequence
    scale: float  # softmax scale, 1 / sqrt(head_dim) for Llama
    cache_meta: Any = None  # layout-specific addressing built by the KV cache (slots, block tables)
    extras: dict[str, Any] = field(default_factory=dict)  # per-backend scratch (e.g. packed masks)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def seq_lens(self) -> list[int]:
        """Tokens in the cache per sequence once this call has written its K/V."""
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens)

    @property
    def is_decode(self) -> bool:
        """True when every sequence contributes exactly one query row (a decode step)."""
        return self.max_query_len == 1 and min(self.context_lens) > 0


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do. ``kvcore backends`` renders its table from these declarations."""

    devices: frozenset[str]  # torch device types, e.g. {"cpu", "cuda"}
    dtypes: frozenset[torch.dtype]
    cache_kinds: tuple[str, ...]  # KV-cache layouts it reads, preferred first ("contiguous", "paged")
    head_dims: frozenset[int] | None = None  # None: any head size
    max_head_dim: int | None = None
    head_dim_multiple: int | None = None  # e.g. 8: kernels that vectorise over head_dim
    supports_gqa: bool = True  # H_kv < H (grouped-query / multi-query attention)
    supports_prefill: bool = True
    supports_decode: bool = True
    min_compute_capability: tuple[int, int] | None = None  # CUDA only, e.g. (8, 0) for sm80

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
        if device.type == "cuda" and self.min_compute_capability and torch.cuda.is_available():
            have = torch.cuda.get_device_capability(device)
            if have < self.min_compute_capability:
                need = ".".join(map(str, self.min_compute_capability))
                reasons.append(f"GPU compute capability {have[0]}.{have[1]} < {need}")
        return reasons


class AttentionBackend(abc.ABC):
    """An attention implementation. Subclass it, declare ``name`` and ``capabilities``, implement
    :meth:`forward`, and register the class through the ``kvcore_register_backends`` hook.

    A backend instance is stateless across requests; all per-sequence state lives in the
    :class:`~kvcore.kv_cache.KVCache` it is handed.
    """

    name: ClassVar[str]
    capabilities: ClassVar[BackendCapabilities]
    description: ClassVar[str] = ""
    #: higher wins when kvcore picks a backend automatically among the available ones
    priority: ClassVar[int] = 0

    def __init__(self, **options: Any) -> None:
        """``options`` come from the ``[backends.<name>]`` table of the config file."""
        if options:
            from kvcore.errors import ConfigError

            raise ConfigError(f"backend '{self.name}' takes no options, got: {', '.join(sorted(options))}")

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

    def create_cache(self, spec: CacheSpec) -> KVCache:
        """Allocate the KV cache this backend prefers (the first of ``capabilities.cache_kinds``)."""
        from kvcore.kv_cache import create_cache

        return create_cache(self.capabilities.cache_kinds[0], spec)

    @abc.abstractmethod
    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Write this call's K/V into ``cache`` at ``meta``'s positions, then attend.

        :param layer_idx: decoder layer, selects the cache layer.
        :param q: ``[T, H, D]`` queries, RoPE already applied.
        :param k: ``[T, H_kv, D]`` new keys, RoPE already applied.
        :param v: ``[T, H_kv, D]`` new values.
        :param cache: the KV cache; its ``kind`` is one of ``capabilities.cache_kinds``.
        :param meta: packing, lengths and cache addressing of this call.
        :returns: ``[T, H, D]`` attention output, same dtype as ``q``.
        """
