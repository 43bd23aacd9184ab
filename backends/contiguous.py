"""``contiguous``: the preallocated per-sequence KV cache (one slot of ``max_seq_len`` tokens per sequence).

Layout "contiguous": ``k`` and ``v`` are ``[L, max_num_seqs, H_kv, max_seq_len, D]``; the core gives
each sequence one block, which here is a whole slot, for its life. Token ``p`` of the sequence in slot
``s`` is written at ``k[layer, s, :, p]`` (gpt-fast's ``k_out[:, :, input_pos] = k_val``), so a backend
reads a sequence's keys as the view ``k[layer, s, :, :seq_len]`` without copying.

Rows past a sequence's length hold zeros or that sequence's own K/V, never an earlier occupant's: a decode
batch may read every slot up to its longest sequence (``sdpa``), where a stale NaN would turn the masked
product NaN (softmax weight 0 × NaN). So when a sequence starts in a slot, :meth:`ContiguousKVCache.before_forward`
zeroes the rows the slot's earlier sequences wrote (as many as they wrote, not the whole slot).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kvcore.hookspecs import hookimpl
from kvcore.interfaces.kv_cache import CacheCapabilities, CacheSpec, KVCache, copy_block_rows, zeros
from kvcore.interfaces.metadata import AttentionMetadata

__all__ = ["ContiguousKVCache", "ALL_DTYPES"]

ALL_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


class ContiguousKVCache(KVCache):
    name = "contiguous"
    layout = "contiguous"
    paged = False
    description = "one preallocated slot of max_seq_len tokens per sequence, [L, slots, H_kv, S, D]"
    capabilities = CacheCapabilities(
        devices=frozenset({"cpu", "cuda"}), dtypes=ALL_DTYPES,
        no_window_pool="one slot of max_seq_len tokens per sequence for its whole life: no block to give back "
        "(choose a paged cache)",
    )

    def __init__(self, spec: CacheSpec, **options: Any) -> None:
        super().__init__(spec, **options)
        self.k = zeros(self.storage_shape(), dtype=spec.dtype, device=spec.device)
        self.v = zeros(self.storage_shape(), dtype=spec.dtype, device=spec.device)
        #: ``k`` and ``v`` as ``[L * slots * H_kv * S, D]`` rows (views of the same memory). A backend that
        #: writes and reads only through these stays traceable by torch.compile: in-place writes into a view
        #: of a compiled function's input would make it copy the whole cache back on every call.
        self.k_rows, self.v_rows = self.k.view(-1, spec.head_dim), self.v.view(-1, spec.head_dim)
        #: per slot, the rows ``[0, n)`` written since it was last zeroed (past them it is all zeros)
        self._rows_written = [0] * self.num_blocks

    #: the axis of ``k`` and ``v`` that is the token's position in its slot (a subclass's layout may move it)
    position_dim: ClassVar[int] = 3

    def storage_shape(self) -> tuple[int, ...]:
        """Shape of ``k`` (and ``v``): layers first, slots second."""
        s = self.spec
        return (s.num_layers, self.num_blocks, s.num_kv_heads, self.block_size, s.head_dim)

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        slots = meta.slot_mapping // self.block_size  # [T]; the offset in a slot is the position
        # Advanced indices split by a slice: the indexed view is [T, H_kv, D], matching k and v.
        self.k[layer_idx, slots, :, meta.positions] = k
        self.v[layer_idx, slots, :, meta.positions] = v

    def before_forward(self, meta: AttentionMetadata) -> None:
        written = self._rows_written
        for slot, ctx, q_len in zip(meta.slots, meta.context_lens, meta.query_lens):
            if ctx == 0 and written[slot]:  # a sequence starts here: clear what earlier ones left
                for t in (self.k, self.v):
                    t[:, slot].narrow(self.position_dim - 1, 0, written[slot]).zero_()
                written[slot] = 0
            written[slot] = max(written[slot], ctx + q_len)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        copy_block_rows((self.k, self.v), pairs)
        for src, dst in pairs:  # the whole slot is copied, its zeros past the written rows too
            self._rows_written[dst] = self._rows_written[src]

    def read(self, layer_idx: int, block_table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        slot = block_table[0] if block_table else 0  # an empty sequence holds no block yet: length is 0
        k = self.k[layer_idx, slot, :, :length].transpose(0, 1).clone()  # [L, H_kv, D]
        v = self.v[layer_idx, slot, :, :length].transpose(0, 1).clone()
        return k, v

    @property
    def kv_bytes_allocated(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@hookimpl
def kvcore_register_kv_caches(register):
    register(ContiguousKVCache)
