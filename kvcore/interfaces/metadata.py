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

import dataclasses
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcore.interfaces.layer_attention import LayerAttention, variants_of

__all__ = ["AttentionMetadata", "cu_seqlens", "host_to_device"]


@dataclass(frozen=True)
class AttentionMetadata:
    """Describes one forward call over a packed batch of ``B`` sequences; built once per step by the core.

    Python lists mirror the small integer tensors so backends can shape work without a device sync.
    Cache addressing is the core's block tables: token ``p`` of sequence ``i`` lives in block
    ``block_tables[i][p // block_size]`` at offset ``p % block_size``; ``slot_mapping`` is that
    address flattened (``block * block_size + offset``) for each packed token. A per-sequence (slot)
    layout has one block per sequence, so ``block_tables[i][0]`` is the sequence's slot.

    With sliding-window layers giving blocks back (:mod:`kvcore.scheduling.kv_groups`), layers are in groups,
    each with its own block tables: :meth:`for_layer` is the metadata a layer writes and reads through (this
    object's own tables are group 0's, the full-attention layers' when the model has any).
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
    scale: float  # softmax scale of a layer without its own spec, from the model (1 / sqrt(head_dim) for Llama)
    #: each decoder layer's attention, from the model; empty: every layer plain causal at ``scale``
    layers: tuple[LayerAttention, ...] = ()
    #: the block-table group of each layer; empty: every layer uses this object's tables
    layer_groups: tuple[int, ...] = ()
    #: per group, this call with the group's ``block_tables``, ``block_tables_t`` and ``slot_mapping``
    groups: tuple[AttentionMetadata, ...] = ()

    def for_layer(self, layer_idx: int) -> AttentionMetadata:
        """The metadata layer ``layer_idx`` writes and reads its K/V through (its group's block tables)."""
        return self.groups[self.layer_groups[layer_idx]] if self.layer_groups else self

    @property
    def group_metas(self) -> tuple[AttentionMetadata, ...]:
        """One metadata per group of layers (a backend plans each once per step)."""
        return self.groups or (self,)

    def with_groups(self, group_tables: Sequence[list[list[int]]], layer_groups: Sequence[int]) -> AttentionMetadata:
        """This call with one set of block tables per group: ``group_tables[g][i]`` is group ``g``'s table of
        sequence ``i`` (group 0's are this call's own); ``layer_groups[l]``: the group of layer ``l``."""
        groups = [self]
        for tables in group_tables[1:]:
            tables_t, slot_mapping = _addressing(self.query_lens, self.context_lens, tables, self.block_size)
            tables_t, slot_mapping = host_to_device([tables_t, slot_mapping], self.positions.device)
            groups.append(dataclasses.replace(self, block_tables=[list(t) for t in tables],
                                              block_tables_t=tables_t, slot_mapping=slot_mapping))
        return dataclasses.replace(self, layer_groups=tuple(layer_groups), groups=tuple(groups))

    def layer(self, layer_idx: int) -> LayerAttention:
        """How layer ``layer_idx`` attends: what a backend's ``forward`` must implement."""
        return self.layers[layer_idx] if self.layers else LayerAttention(self.scale)

    @property
    def variants(self) -> frozenset[str]:
        """The variants this call's layers use (what the backend must declare for the call's phase)."""
        return variants_of(self.layers)

    @property
    def num_seqs(self) -> int:
        """``B``: sequences in this call."""
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        """``T``: packed query rows in this call."""
        return int(self.positions.shape[0])

    @property
    def seq_lens(self) -> list[int]:
        """Tokens in the cache per sequence once this call has written its K/V."""
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]

    @property
    def max_query_len(self) -> int:
        """The longest ``query_lens`` entry (1 in a decode step)."""
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        """The longest ``seq_lens`` entry: keys the longest sequence attends to after this call's writes."""
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
        layers: Sequence[LayerAttention] = (),
    ) -> AttentionMetadata:
        """The metadata of one call: ``query_lens[i]`` new tokens after ``context_lens[i]`` cached ones;
        ``layers``: each decoder layer's attention (empty: plain causal at ``scale``)."""
        # built from the host lists in Python: a decode step's few values cost one tensor each this way, where
        # deriving them with tensor ops costs a dispatch per op (and a long prefill's lists are still cheap)
        positions = torch.tensor(_positions(query_lens, context_lens), dtype=torch.int64)  # [T]
        seq_lens = torch.tensor([c + q for c, q in zip(context_lens, query_lens)], dtype=torch.int32)
        tables, slot_mapping = _addressing(query_lens, context_lens, block_tables, block_size)
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
            layers=tuple(layers),
        )


def _positions(query_lens: Sequence[int], context_lens: Sequence[int]) -> list[int]:
    """The absolute position of every packed token ``[T]``."""
    return [p for c, q in zip(context_lens, query_lens) for p in range(c, c + q)]


def _addressing(
    query_lens: Sequence[int], context_lens: Sequence[int], block_tables: Sequence[list[int]], block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host tensors ``(block_tables_t [B, max_blocks] int32, slot_mapping [T] int64)`` of one call."""
    max_blocks = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.int32)
    slots = [t[p // block_size] * block_size + p % block_size
             for t, c, q in zip(block_tables, context_lens, query_lens) for p in range(c, c + q)]
    return tables, torch.tensor(slots, dtype=torch.int64)


def cu_seqlens(lengths: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 prefix sums ``[0, l0, l0 + l1, ...]`` ``[B + 1]``: row offsets of packed sequences (flash-attn's
    ``cu_seqlens``)."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


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
