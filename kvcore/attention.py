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
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch

if TYPE_CHECKING:
    from kvcore.kv_cache import KVCache

__all__ = [
    "AttentionMetadata",
    "BackendCapabilities",
    "AttentionBackend",
    "causal_mask",
    "cu_seqlens",
    "host_to_device",
]

#: a backend's own per-call plan type (``AttentionMetadata`` itself when it needs nothing more)
PlanT = TypeVar("PlanT")


@dataclass(frozen=True)
class AttentionMetadata:
    """Describes one forward call over a packed batch of ``B`` sequences; built once per step by the core.

    Python lists mirror the small integer tensors so backends can shape work without a device sync.
    Cache addressing is the core's block tables: token ``p`` of sequence ``i`` lives in block
    ``block_tables[i][p // block_size]`` at offset ``p % block_size``; ``slot_mapping`` is that
    address flattened (``block * block_size + offset``) for each packed token. A per-sequence (slot)
    layout has one block per sequence, so ``block_tables[i][0]`` is the sequence's slot.
    """

    query_lens: list[int]  # new tokens per sequence, length B
    context_lens: list[int]  # tokens already cached before this call, length B
    block_tables: list[list[int]]  # [B] physical block ids per sequence, in token order
    block_size: int  # tokens per block of the cache this call writes
    positions: torch.Tensor  # [T] int64, absolute position of every packed query token
    cu_seqlens_q: torch.Tensor  # [B + 1] int32, prefix sums of query_lens (row offsets into T)
    seq_lens_t: torch.Tensor  # [B] int32, context_len + query_len per sequence
    block_tables_t: torch.Tensor  # [B, max_blocks] int32, padded with block 0 (masked by seq_lens)
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset of every packed token
    scale: float  # softmax scale, from the model (1 / sqrt(head_dim) for Llama)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

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

    @functools.cached_property
    def query_starts(self) -> list[int]:
        """``cu_seqlens_q`` as a host list ``[B + 1]``: row offsets of the sequences without a device sync."""
        return [0, *itertools.accumulate(self.query_lens)]

    @property
    def is_decode(self) -> bool:
        """True when every sequence contributes exactly one query row (a decode step)."""
        return self.max_query_len == 1 and min(self.context_lens) > 0

    @property
    def slots(self) -> list[int]:
        """First block of each sequence: its slot in a per-sequence layout."""
        return [table[0] for table in self.block_tables]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        scale: float,
        device: torch.device,
    ) -> AttentionMetadata:
        """The metadata of one call: ``query_lens[i]`` new tokens after ``context_lens[i]`` cached ones."""
        positions = torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)])  # [T]
        seq_lens = torch.tensor([c + q for c, q in zip(context_lens, query_lens)], dtype=torch.int32)
        max_blocks = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.int32)
        seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))  # [T]
        blocks = tables.long()[seq_of_token, positions // block_size]
        slot_mapping = blocks * block_size + positions % block_size
        # built on the host, sent in one copy (a step's metadata is small; one copy per tensor would not be)
        positions, cu_q, seq_lens, tables, slot_mapping = host_to_device(
            [positions, cu_seqlens(query_lens), seq_lens, tables, slot_mapping], device
        )
        return cls(
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            block_tables=[list(t) for t in block_tables],
            block_size=block_size,
            positions=positions,
            cu_seqlens_q=cu_q,
            seq_lens_t=seq_lens,
            block_tables_t=tables,
            slot_mapping=slot_mapping,
            scale=scale,
        )


def cu_seqlens(lengths: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 prefix sums ``[0, l0, l0 + l1, ...]`` ``[B + 1]``: row offsets of packed sequences (flash-attn's
    ``cu_seqlens``)."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return out.to(device)


def host_to_device(tensors: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Small host integer tensors on ``device`` in one copy, same shapes and dtypes (as they are on the CPU).

    On CUDA they are packed into one pinned int64 staging buffer and copied with ``non_blocking=True``: the
    host does not wait for the copy, and torch's pinned-memory cache keeps the buffer until the copy ran.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return list(tensors)
    flat = [t.reshape(-1).to(torch.int64) for t in tensors]
    staging = torch.empty(sum(f.numel() for f in flat), dtype=torch.int64, pin_memory=device.type == "cuda")
    torch.cat(flat, out=staging)
    packed = staging.to(device, non_blocking=True)
    out, start = [], 0
    for t in tensors:
        # a device-side copy each (casts included): no returned tensor aliases another, so a compiled
        # step's inputs are plain tensors and an in-place op on one cannot reach the rest
        out.append(packed[start : start + t.numel()].view(t.shape).to(t.dtype, copy=True))
        start += t.numel()
    return out


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
    #: tensors, never views of them (see kvcore/compile.py)
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
    :class:`~kvcore.kv_cache.KVCache` it is handed, all per-call state in the plan.
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
