"""The core's handle on one KV cache: the layout's storage plus the block tables that address it.

:meth:`KVCacheManager.reserve` makes room for a forward call's new tokens (all or nothing) and has the cache
make the copy-on-write copies; :meth:`KVCacheManager.metadata` then builds the
:class:`~kvcore.interfaces.attention.AttentionMetadata` every layer and backend reads, once per step
(:meth:`KVCacheManager.prepare` does both).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcore.errors import ConfigError
from kvcore.interfaces.kv_cache import KVCache
from kvcore.interfaces.layer_attention import LayerAttention
from kvcore.interfaces.metadata import AttentionMetadata
from kvcore.scheduling.block_manager import BlockManager
from kvcore.scheduling.kv_groups import KVGroup, KVGroups, first_live_block

__all__ = ["KVCacheManager", "KVCapacity"]


@dataclass(frozen=True)
class KVCapacity:
    """What the KV cache holds for sequences of ``max_seq_len`` tokens, once computed (window groups keep the
    blocks their next query reads)."""

    num_blocks: int
    block_bytes: int  # bytes of one block id (every storage layer)
    seq_blocks: int  # blocks such a sequence holds
    seq_bytes: int  # bytes of K/V it holds (tokens, not whole blocks)
    seq_bytes_all_layers: int  # the same if every layer kept every token
    window_pool: str  # "on", or why sliding-window layers keep every token

    @property
    def num_seqs(self) -> int:
        """Such sequences the pool holds at once."""
        return self.num_blocks // self.seq_blocks


class KVCacheManager:
    """A :class:`~kvcore.interfaces.kv_cache.KVCache` and the
    :class:`~kvcore.scheduling.block_manager.BlockManager` over its blocks. Sequences are addressed by
    integer ``seq_id``. ``groups``: the layers' block-table groups (:mod:`kvcore.scheduling.kv_groups`; the
    cache was made with their ``layer_storage``); None: one group of every layer, keeping every token."""

    def __init__(self, cache: KVCache, *, enable_prefix_caching: bool = False, namespace: str = "",
                 groups: KVGroups | None = None, window_pool: str = "on") -> None:
        self.cache = cache
        self.groups = groups or KVGroups((KVGroup(tuple(range(cache.spec.num_layers)), None),))
        if self.groups.layer_storage != cache.spec.layer_storage:
            raise ConfigError("KV cache manager: the cache's layer_storage must be its groups' layer_storage")
        self.window_pool = window_pool  # "on", or why off (the capacity report says it)
        self.blocks = BlockManager(
            cache.num_blocks,
            cache.block_size,
            cache.spec.max_seq_len,
            enable_prefix_caching=enable_prefix_caching,
            namespace=namespace,
            windows=self.groups.windows,
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

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens of ``seq_id``, giving back the blocks past them."""
        self.blocks.truncate(seq_id, num_tokens)

    @property
    def max_seq_len(self) -> int:
        return self.blocks.max_seq_len

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    # -- one forward call ----------------------------------------------------------------------------
    def prepare(
        self, seq_ids: Sequence[int], query_lens: Sequence[int], scale: float, layers: Sequence[LayerAttention] = ()
    ) -> AttentionMetadata:
        """Reserve room for ``query_lens[i]`` new tokens of each sequence and describe the call (``layers``:
        each layer's attention as the engine runs it: the model's, with its attention variants bound).

        All or nothing: when the batch does not fit, nothing is reserved and the error names it.
        """
        self.reserve(seq_ids, query_lens)
        return self.metadata(seq_ids, query_lens, scale, layers)

    def reserve(self, seq_ids: Sequence[int], query_lens: Sequence[int]) -> list[tuple[int, int]]:
        """Make room for ``query_lens[i]`` more tokens of each sequence (all or nothing) and have the cache make
        the copy-on-write copies that takes; returns them as ``(src, dst)`` block pairs."""
        copies = self.blocks.reserve(seq_ids, query_lens)
        if copies:
            self.cache.copy_blocks(copies)
        return copies

    def metadata(
        self, seq_ids: Sequence[int], query_lens: Sequence[int], scale: float, layers: Sequence[LayerAttention] = ()
    ) -> AttentionMetadata:
        """Describe a forward of the last ``query_lens[i]`` reserved tokens of each sequence."""
        context_lens = [self.blocks.seq_len(s) - n for s, n in zip(seq_ids, query_lens)]
        tables = [[self.blocks.block_table(s, g) for s in seq_ids] for g in range(self.blocks.num_groups)]
        meta = AttentionMetadata.build(
            list(query_lens), context_lens, tables[0], self.cache.block_size, scale, self.cache.spec.device, layers
        )
        return meta.with_groups(tables, self.groups.layer_groups) if len(tables) > 1 else meta

    def read(self, layer_idx: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's cached K and V as layer ``layer_idx`` reads them, each ``[seq_len, H_kv, D]`` (a copy;
        rows of blocks the layer's window gave back hold whatever block 0 holds)."""
        table = self.blocks.block_table(seq_id, self.groups.layer_groups[layer_idx])
        return self.cache.read(layer_idx, table, self.blocks.seq_len(seq_id))

    # -- accounting ----------------------------------------------------------------------------------
    def kv_bytes_in_use(self, seq_id: int | None = None) -> int:
        """Bytes of K/V holding live tokens (one sequence, or all): per group, the tokens whose blocks it
        still holds times one token's bytes in a block id (:meth:`KVCache.token_bytes`)."""
        seqs = self.blocks.seq_ids if seq_id is None else [seq_id]
        return sum(sum(self.blocks.num_tokens_held(s)) for s in seqs) * self.cache.bytes_per_token

    def capacity(self) -> KVCapacity:
        """What the pool holds for sequences of ``max_seq_len`` tokens, with and without the window pool."""
        spec, bs, n = self.cache.spec, self.cache.block_size, self.cache.spec.max_seq_len
        dead = [first_live_block(n, w, bs) for w in self.groups.windows]  # blocks given back per group
        token = self.cache.bytes_per_token  # one token in a block id
        return KVCapacity(
            num_blocks=self.cache.num_blocks,
            block_bytes=token * bs,
            seq_blocks=sum(math.ceil(n / bs) - d for d in dead),
            seq_bytes=sum(n - d * bs for d in dead) * token,
            seq_bytes_all_layers=n * token // spec.num_storage_layers * spec.num_layers,
            window_pool=self.window_pool,
        )
