"""The core's handle on one KV cache: the layout's storage plus the block tables that address it.

:meth:`KVCacheManager.prepare` is where a forward call's addressing is made, once per step: reserve
room for the new tokens (all or nothing), have the cache make the copy-on-write copies, and build the
:class:`~kvcore.interfaces.attention.AttentionMetadata` every layer and backend reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore.interfaces.kv_cache import KVCache
from kvcore.interfaces.layer_attention import LayerAttention
from kvcore.interfaces.metadata import AttentionMetadata
from kvcore.scheduling.block_manager import BlockManager

__all__ = ["KVCacheManager"]


class KVCacheManager:
    """A :class:`~kvcore.interfaces.kv_cache.KVCache` and the
    :class:`~kvcore.scheduling.block_manager.BlockManager` over its blocks. Sequences are addressed by
    integer ``seq_id``."""

    def __init__(self, cache: KVCache, *, enable_prefix_caching: bool = False, namespace: str = "") -> None:
        self.cache = cache
        self.last_copies: list[tuple[int, int]] = []  # the copy-on-write copies the latest prepare() made
        self.blocks = BlockManager(
            cache.num_blocks,
            cache.block_size,
            cache.spec.max_seq_len,
            enable_prefix_caching=enable_prefix_caching,
            namespace=namespace,
        )

    # -- sequences (delegated to the block manager) ---------------------------------------------------
    def can_add_sequence(self) -> bool:
        return self.blocks.can_add_sequence()

    def add_sequence(self, seq_id: int, token_ids: Sequence[int] = (), cache_salt: str | None = None) -> int:
        """Start ``seq_id``; returns how many leading tokens of ``token_ids`` are already cached (under
        the same ``cache_salt``)."""
        return self.blocks.add_sequence(seq_id, token_ids, cache_salt)

    def free_sequence(self, seq_id: int) -> None:
        self.blocks.free_sequence(seq_id)

    def fork_sequence(self, src_seq_id: int, dst_seq_id: int) -> None:
        self.blocks.fork_sequence(src_seq_id, dst_seq_id)

    def seq_len(self, seq_id: int) -> int:
        return self.blocks.seq_len(seq_id)

    def can_reserve(self, seq_ids: Sequence[int], query_lens: Sequence[int]) -> bool:
        return self.blocks.can_reserve(seq_ids, query_lens)

    # -- one forward call ----------------------------------------------------------------------------
    def prepare(
        self, seq_ids: Sequence[int], query_lens: Sequence[int], scale: float, layers: Sequence[LayerAttention] = ()
    ) -> AttentionMetadata:
        """Reserve room for ``query_lens[i]`` new tokens of each sequence and describe the call (``layers``:
        the model's per-layer attention, :attr:`~kvcore.model.decoder.DecoderModel.attention_layers`).

        All or nothing: when the batch does not fit, nothing is reserved and the error names it.
        """
        context_lens = [self.blocks.seq_len(s) for s in seq_ids]
        copies = self.blocks.reserve(seq_ids, query_lens)
        self.last_copies = copies  # tensor parallelism repeats them on the other ranks' caches
        if copies:
            self.cache.copy_blocks(copies)
        return AttentionMetadata.build(
            list(query_lens),
            context_lens,
            [self.blocks.block_table(s) for s in seq_ids],
            self.cache.block_size,
            scale,
            self.cache.spec.device,
            layers,
        )

    def read(self, layer_idx: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's cached K and V, each ``[seq_len, H_kv, D]`` (a copy)."""
        return self.cache.read(layer_idx, self.blocks.block_table(seq_id), self.blocks.seq_len(seq_id))

    # -- accounting ----------------------------------------------------------------------------------
    def kv_bytes_in_use(self, seq_id: int | None = None) -> int:
        """Bytes of K/V holding live tokens (one sequence, or all)."""
        tokens = self.blocks.num_tokens_in_use if seq_id is None else self.blocks.seq_len(seq_id)
        return tokens * self.cache.bytes_per_token
