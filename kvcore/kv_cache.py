"""The KV-cache interface and the contiguous (preallocated, per-slot) cache.

A cache holds, for every decoder layer, the K and V rows of every live sequence. It is allocated once
and written in place at each token's position; it is never grown with ``torch.cat``.

Memory: ``2 × layers × kv_heads × head_dim × seq_len × bytes_per_element`` per sequence.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcore.attention import AttentionMetadata
from kvcore.errors import ConfigError, ContextLengthError, KVCoreError, OutOfBlocksError

__all__ = [
    "CacheSpec",
    "KVCache",
    "SlotKVCache",
    "SlotCacheMeta",
    "ContiguousKVCache",
    "create_cache",
    "register_cache_kind",
    "cache_kinds",
]


@dataclass(frozen=True)
class CacheSpec:
    """Sizes of a KV cache."""

    num_layers: int
    num_kv_heads: int  # H_kv
    head_dim: int  # D
    dtype: torch.dtype
    device: torch.device
    max_num_seqs: int  # sequences resident at the same time
    max_seq_len: int  # tokens per sequence (prompt + generated)
    block_size: int = 16  # paged caches only: tokens per block
    num_blocks: int | None = None  # paged caches only; None = enough for max_num_seqs × max_seq_len

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_num_seqs", "max_seq_len", "block_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"cache: {name} must be positive, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError(f"cache: num_blocks must be positive, got {self.num_blocks}")

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers (K and V)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


class KVCache(abc.ABC):
    """Per-layer K/V storage for a set of sequences, addressed by integer ``seq_id``.

    Life of a sequence: :meth:`add_sequence` → (:meth:`prepare` → backend writes with :meth:`write`)
    repeated → :meth:`free_sequence`. :meth:`prepare` reserves room for the new tokens *before* any
    layer runs, so running out of space fails cleanly without touching other sequences.
    """

    kind: ClassVar[str]

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self._seq_lens: dict[int, int] = {}

    # -- sequence bookkeeping ------------------------------------------------------------------------
    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._seq_lens

    def seq_len(self, seq_id: int) -> int:
        """Tokens currently cached for ``seq_id``."""
        try:
            return self._seq_lens[seq_id]
        except KeyError:
            raise KVCoreError(f"sequence {seq_id} is not in the KV cache") from None

    @property
    def seq_ids(self) -> list[int]:
        return list(self._seq_lens)

    @abc.abstractmethod
    def can_add_sequence(self) -> bool:
        """Whether :meth:`add_sequence` would succeed now."""

    @abc.abstractmethod
    def add_sequence(self, seq_id: int) -> None:
        """Start an empty sequence. Raises :class:`OutOfBlocksError` when the cache is full."""

    @abc.abstractmethod
    def free_sequence(self, seq_id: int) -> None:
        """Forget ``seq_id`` and give its storage back."""

    def fork_sequence(self, src_seq_id: int, dst_seq_id: int) -> None:
        """Make ``dst`` a copy of ``src`` (same cached tokens). Paged caches share blocks copy-on-write."""
        raise KVCoreError(f"the {self.kind} KV cache cannot fork sequences")

    @abc.abstractmethod
    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        """Whether ``num_tokens`` more tokens fit for ``seq_id``."""

    def can_prepare(self, seq_ids: list[int], query_lens: list[int]) -> bool:
        """Whether one :meth:`prepare` call for these sequences would fit (counted together)."""
        return all(self.can_append(s, n) for s, n in zip(seq_ids, query_lens))

    # -- per-call addressing -------------------------------------------------------------------------
    def prepare(self, seq_ids: list[int], query_lens: list[int], scale: float) -> AttentionMetadata:
        """Reserve room for ``query_lens[i]`` new tokens of each sequence and describe the call.

        All-or-nothing: when any sequence does not fit, nothing is reserved and the error names it.
        After this call :meth:`seq_len` already counts the new tokens.
        """
        if len(seq_ids) != len(query_lens) or not seq_ids:
            raise KVCoreError("prepare() needs one query length per sequence and at least one sequence")
        if len(set(seq_ids)) != len(seq_ids):
            raise KVCoreError(f"prepare() got a sequence twice: {seq_ids}")
        for seq_id, num_new in zip(seq_ids, query_lens):
            if num_new <= 0:
                raise KVCoreError(f"sequence {seq_id}: query length must be positive, got {num_new}")
            if not self.can_append(seq_id, num_new):
                have = self.seq_len(seq_id)
                if have + num_new > self.spec.max_seq_len:
                    raise ContextLengthError(
                        f"sequence {seq_id}: {have} + {num_new} tokens exceed the cache's max_seq_len "
                        f"{self.spec.max_seq_len}"
                    )
                raise OutOfBlocksError(f"sequence {seq_id}: no KV-cache room for {num_new} more tokens")
        context_lens = [self._seq_lens[s] for s in seq_ids]
        self._reserve(seq_ids, query_lens)
        for seq_id, num_new in zip(seq_ids, query_lens):
            self._seq_lens[seq_id] += num_new

        device = self.spec.device
        positions = torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)]).to(device)
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        meta = AttentionMetadata(
            seq_ids=list(seq_ids),
            query_lens=list(query_lens),
            context_lens=context_lens,
            positions=positions,
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            scale=scale,
        )
        meta.cache_meta = self._cache_meta(meta)
        return meta

    @abc.abstractmethod
    def _reserve(self, seq_ids: list[int], query_lens: list[int]) -> None:
        """Take storage for the new tokens (called only after ``can_append`` said yes for all)."""

    @abc.abstractmethod
    def _cache_meta(self, meta: AttentionMetadata) -> object:
        """Layout-specific addressing for ``meta`` (slot indices, block tables, slot mapping)."""

    @abc.abstractmethod
    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store ``k``, ``v`` (``[T, H_kv, D]``, packed like ``meta``) at their positions."""

    @abc.abstractmethod
    def read(self, layer_idx: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy of a sequence's cached K and V, each ``[seq_len, H_kv, D]`` (tests, debugging)."""

    # -- accounting ----------------------------------------------------------------------------------
    @property
    def num_tokens_in_use(self) -> int:
        """Tokens cached across all live sequences."""
        return sum(self._seq_lens.values())

    def kv_bytes_in_use(self, seq_id: int | None = None) -> int:
        """Bytes of K/V holding live tokens (one sequence, or all)."""
        tokens = self.num_tokens_in_use if seq_id is None else self.seq_len(seq_id)
        return tokens * self.spec.bytes_per_token

    @property
    @abc.abstractmethod
    def kv_bytes_allocated(self) -> int:
        """Bytes the cache's storage occupies."""


class SlotKVCache(KVCache):
    """Base of the per-slot caches: one preallocated row ("slot") of ``max_seq_len`` tokens per
    sequence for its whole life. Subclasses choose the tensor layout of ``k`` / ``v``."""

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        self.k = torch.zeros(self._storage_shape(spec), dtype=spec.dtype, device=spec.device)
        self.v = torch.zeros(self._storage_shape(spec), dtype=spec.dtype, device=spec.device)
        self._free_slots = list(range(spec.max_num_seqs - 1, -1, -1))  # pop() hands out the lowest
        self.slot_of: dict[int, int] = {}

    @staticmethod
    @abc.abstractmethod
    def _storage_shape(spec: CacheSpec) -> tuple[int, ...]:
        """Shape of ``k`` (and ``v``), ``num_layers`` first and ``max_num_seqs`` second."""

    @abc.abstractmethod
    def _copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Copy the first ``length`` tokens of every layer from one slot to another."""

    def can_add_sequence(self) -> bool:
        return bool(self._free_slots)

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self._seq_lens:
            raise KVCoreError(f"sequence {seq_id} is already in the KV cache")
        if not self._free_slots:
            raise OutOfBlocksError(f"{self.kind} KV cache is full ({self.spec.max_num_seqs} sequences)")
        self.slot_of[seq_id] = self._free_slots.pop()
        self._free_slots.sort(reverse=True)
        self._seq_lens[seq_id] = 0

    def free_sequence(self, seq_id: int) -> None:
        self.seq_len(seq_id)  # raises for an unknown id
        del self._seq_lens[seq_id]
        self._free_slots.append(self.slot_of.pop(seq_id))
        self._free_slots.sort(reverse=True)

    def fork_sequence(self, src_seq_id: int, dst_seq_id: int) -> None:
        length = self.seq_len(src_seq_id)
        self.add_sequence(dst_seq_id)
        self._copy_prefix(self.slot_of[src_seq_id], self.slot_of[dst_seq_id], length)
        self._seq_lens[dst_seq_id] = length

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        return self.seq_len(seq_id) + num_tokens <= self.spec.max_seq_len

    def _reserve(self, seq_ids: list[int], query_lens: list[int]) -> None:
        pass  # the slot already spans max_seq_len

    def _cache_meta(self, meta: AttentionMetadata) -> SlotCacheMeta:
        slots = [self.slot_of[s] for s in meta.seq_ids]
        slots_t = torch.tensor(slots, dtype=torch.long, device=self.spec.device)
        counts = torch.tensor(meta.query_lens, device=self.spec.device)
        return SlotCacheMeta(
            slots=slots,
            slots_t=slots_t,
            slots_i32=slots_t.to(torch.int32),
            token_slots=slots_t.repeat_interleave(counts),
        )

    @property
    def kv_bytes_allocated(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@dataclass
class SlotCacheMeta:
    slots: list[int]  # [B] slot of each sequence
    slots_t: torch.Tensor  # [B] int64
    slots_i32: torch.Tensor  # [B] int32 (e.g. flash-attn's cache_batch_idx)
    token_slots: torch.Tensor  # [T] int64, slot of every packed token


class ContiguousKVCache(SlotKVCache):
    """One preallocated slab per layer: ``k[layer]`` is ``[max_num_seqs, H_kv, max_seq_len, D]``.

    A sequence owns one slot (row) for its whole life; token ``p`` of it is written at
    ``k[layer, slot, :, p]`` (gpt-fast's ``k_out[:, :, input_pos] = k_val``).
    """

    kind = "contiguous"

    @staticmethod
    def _storage_shape(spec: CacheSpec) -> tuple[int, ...]:
        return (spec.num_layers, spec.max_num_seqs, spec.num_kv_heads, spec.max_seq_len, spec.head_dim)

    def _copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        self.k[:, dst_slot, :, :length] = self.k[:, src_slot, :, :length]
        self.v[:, dst_slot, :, :length] = self.v[:, src_slot, :, :length]

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        cm: SlotCacheMeta = meta.cache_meta
        # Advanced indices split by a slice: the indexed view is [T, H_kv, D], matching k and v.
        self.k[layer_idx, cm.token_slots, :, meta.positions] = k
        self.v[layer_idx, cm.token_slots, :, meta.positions] = v

    def read(self, layer_idx: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        slot, length = self.slot_of[seq_id], self.seq_len(seq_id)
        k = self.k[layer_idx, slot, :, :length].transpose(0, 1).clone()  # [L, H_kv, D]
        v = self.v[layer_idx, slot, :, :length].transpose(0, 1).clone()
        return k, v


ContiguousCacheMeta = SlotCacheMeta  # the name backends written against the first release import


_CACHE_KINDS: dict[str, type[KVCache]] = {"contiguous": ContiguousKVCache}


def register_cache_kind(cls: type[KVCache]) -> type[KVCache]:
    """Make a cache class creatable by its ``kind`` name (usable as a class decorator)."""
    existing = _CACHE_KINDS.get(cls.kind)
    if existing is not None and existing is not cls:
        raise KVCoreError(f"cache kind '{cls.kind}' is already provided by {existing.__qualname__}")
    _CACHE_KINDS[cls.kind] = cls
    return cls


def cache_kinds() -> list[str]:
    return sorted(_CACHE_KINDS)


def create_cache(kind: str, spec: CacheSpec) -> KVCache:
    try:
        cls = _CACHE_KINDS[kind]
    except KeyError:
        raise ConfigError(f"unknown KV cache kind '{kind}' (known: {', '.join(cache_kinds())})") from None
    return cls(spec)
