"""``paged``: a block-pool (PagedAttention-style) KV cache and the backend that reads it.

Cache layout "paged"
    One pool per K and V, ``k_pool`` ``[L, num_blocks, block_size, H_kv, D]`` (``L``: the storage layers;
    layer ``l`` is row ``rows[l]``, from ``CacheSpec.layer_storage`` when sliding-window layers share rows).
    The core's block manager gives each sequence a block table (blocks taken only as the sequence grows,
    shared copy-on-write after a fork), so token ``p`` lives at ``k_pool[rows[layer], table[p // block_size],
    p % block_size]``; a layer whose window gives blocks back reads its own group's table (the metadata's
    ``for_layer``), which the per-group plans of the runner hand it.
    A layout-"paged" cache is read only through :meth:`PagedKVCache.gather_blocks`, so another storage
    (the quantized ``int8`` cache) serves the same backend. Option ``block_size`` (``[kv_caches.paged]``;
    default ``EngineConfig.block_size``, 16).

Backend
    :class:`PagedBackend` writes K/V through ``slot_mapping`` (one ``index_copy_`` per pool, no loop over
    tokens), then attends through the block tables:

    * decode (every query length 1): one gather of every sequence's blocks (``index_select`` over the
      ``[num_blocks, block_size·H_kv·D]`` view of the layer's pool) → ``[B, max_blocks·block_size, H_kv,
      D]``, a key-padding mask from ``seq_lens`` and one batched ``scaled_dot_product_attention`` call.
      GQA without repeating K/V: the ``H / H_kv`` query heads of a group are laid out as that KV head's
      query rows (``q.view(B, H_kv, G, D)``).
    * prefill (ragged query lengths, possibly continuing a cache): a loop over sequences (never over heads
      or tokens), each gathering its own blocks, with the causal mask aligned bottom-right.

    Attention runs in the input dtype; SDPA accumulates the softmax in float32 for half types.

    Attention variants (:class:`~kvcore.interfaces.attention.LayerAttention`): a sliding window narrows the masks
    (planned once per window for decode); layers with soft-capping or sinks run
    :func:`~kvcore.interfaces.attention.explicit_attention` over the same gathered blocks and masks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from kvcore.errors import ConfigError
from kvcore.hookspecs import hookimpl
from kvcore.interfaces.attention import AttentionBackend, BackendCapabilities, causal_mask, explicit_attention
from kvcore.interfaces.kv_cache import CacheCapabilities, CacheSpec, KVCache, copy_block_rows, zeros
from kvcore.interfaces.layer_attention import VARIANTS, LayerAttention
from kvcore.interfaces.metadata import AttentionMetadata, host_to_device

from .contiguous import ALL_DTYPES

__all__ = ["PagedKVCache", "PagedBackend", "PagedPlan", "block_size_option"]


def block_size_option(spec: CacheSpec, block_size: object, cache: str) -> CacheSpec:
    """``spec`` with the ``block_size`` option of a paged cache applied (``None`` keeps the engine's)."""
    if block_size is None:
        return spec
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ConfigError(f"KV cache '{cache}': block_size must be a positive integer, got {block_size!r}")
    return replace(spec, block_size=block_size)


class PagedKVCache(KVCache):
    """K/V in fixed-size blocks of one pool per layer (see the module docstring).

    ``num_blocks`` is ``spec.num_blocks`` or, when unset, ``ceil(max_num_seqs * max_seq_len / block_size)``.
    """

    name = "paged"
    layout = "paged"
    paged = True
    description = "block pool [L, blocks, block_size, H_kv, D]; blocks taken as sequences grow"
    capabilities = CacheCapabilities(devices=frozenset({"cpu", "cuda"}), dtypes=ALL_DTYPES, no_window_pool=None)

    def __init__(self, spec: CacheSpec, block_size: int | None = None, **options: Any) -> None:
        super().__init__(block_size_option(spec, block_size, self.name), **options)
        spec = self.spec
        #: the pool row of each model layer: its storage layer (CacheSpec.layer_storage)
        self.rows = spec.layer_storage or tuple(range(spec.num_layers))
        shape = (spec.num_storage_layers, self.num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        self.k_pool = zeros(shape, dtype=self.storage_dtype, device=spec.device)
        self.v_pool = zeros(shape, dtype=self.storage_dtype, device=spec.device)

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.spec.dtype

    # -- the "paged" layout contract -----------------------------------------------------------------
    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        h_kv, d, row = self.spec.num_kv_heads, self.spec.head_dim, self.rows[layer_idx]
        self.k_pool[row].view(-1, h_kv, d).index_copy_(0, meta.slot_mapping, k.to(self.k_pool.dtype))
        self.v_pool[row].view(-1, h_kv, d).index_copy_(0, meta.slot_mapping, v.to(self.v_pool.dtype))

    def gather_blocks(self, layer_idx: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of blocks ``block_ids`` (``[n]`` int64), each ``[n, block_size, H_kv, D]`` (a copy): the
        layout-"paged" contract. Here the pool's own rows (the model dtype); a cache storing a narrower type
        overrides it to return floating values the backend casts to its compute dtype. ``index_select``
        over rows of ``block_size·H_kv·D``: on CPU several times faster than advanced indexing of the pool."""
        shape, row = (-1, self.block_size, self.spec.num_kv_heads, self.spec.head_dim), self.rows[layer_idx]
        k = self.k_pool[row].view(self.num_blocks, -1).index_select(0, block_ids).view(shape)
        v = self.v_pool[row].view(self.num_blocks, -1).index_select(0, block_ids).view(shape)
        return k, v

    # -- the rest of KVCache -------------------------------------------------------------------------
    def storage(self) -> tuple[torch.Tensor, ...]:
        """Every tensor indexed ``[layer, block, ...]``: what a block copy copies and the allocation counts."""
        return self.k_pool, self.v_pool

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        copy_block_rows(self.storage(), pairs)

    def read(self, layer_idx: int, block_table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(block_table, dtype=torch.long, device=self.spec.device)
        k, v = self.gather_blocks(layer_idx, idx)
        h_kv, d = self.spec.num_kv_heads, self.spec.head_dim
        return k.reshape(-1, h_kv, d)[:length].clone(), v.reshape(-1, h_kv, d)[:length].clone()

    @property
    def kv_bytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.storage())


@dataclass(frozen=True)
class PagedPlan:
    """What every layer of one forward call shares."""

    meta: AttentionMetadata
    flat_tables: torch.Tensor  # [B * max_blocks] int64, every sequence's padded block table (decode)
    key_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool, True = a real key (decode)
    tables: list[torch.Tensor]  # [B] int64 block tables (prefill)
    #: a fresh prefill (context 0) over a lossless cache attends to this call's own K/V, which equal what
    #: was just written: no gather back from the pool
    fresh_from_input: bool = False
    #: sliding window -> ``key_mask`` narrowed to each row's last ``window`` keys (decode)
    window_masks: dict[int, torch.Tensor] | None = None
    #: sliding window (None: none) -> ``[n]`` int64 rows ``b * keys + j`` of the gathered keys its mask hides, None
    #: when it hides none (decode)
    hidden_rows: dict[int | None, torch.Tensor | None] | None = None


class PagedBackend(AttentionBackend[PagedPlan]):
    name = "paged"
    description = "block-table KV cache (copy-on-write forks); vectorised gather + SDPA"
    priority = 5
    capabilities = BackendCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=ALL_DTYPES,
        kv_layouts=("paged",),
        prefill_variants=frozenset(VARIANTS),
        decode_variants=frozenset(VARIANTS),
        multi_token_decode=True,  # several-token rows take the chunked-prefill path
    )

    def plan(self, meta: AttentionMetadata, cache: PagedKVCache) -> PagedPlan:
        device = meta.positions.device
        if meta.max_query_len == 1:
            bt = meta.block_tables_t.long()  # [B, MB]
            keys = bt.shape[1] * meta.block_size
            key_pos, lens = torch.arange(keys, device=device)[None, :], meta.seq_lens_t[:, None]
            valid = key_pos < lens  # [B, keys]
            windows = {layer.sliding_window for layer in meta.layers} - {None}
            window_masks = {w: (valid & (key_pos >= lens - w))[:, None, None, :] for w in windows}
            hidden = {w: self._hidden_rows(meta.seq_lens, keys, w, device) for w in windows | {None}}
            return PagedPlan(meta, bt.flatten(), valid[:, None, None, :], [], window_masks=window_masks,
                             hidden_rows=hidden)
        tables = host_to_device([torch.tensor(t, dtype=torch.long) for t in meta.block_tables], device)
        lossless = cache.capabilities.unit_roundoff is None
        return PagedPlan(meta, torch.empty(0, dtype=torch.long), None, tables, fresh_from_input=lossless)

    @staticmethod
    def _hidden_rows(seq_lens: list[int], keys: int, window: int | None, device: torch.device) -> torch.Tensor | None:
        """Rows ``b * keys + j`` of a decode batch's gathered keys that row ``b`` does not see: past its length (the
        rest of its last block, the padding blocks) and, with a window, before it. Made on the host from the host
        lengths (no device sync); None when there are none."""
        pos, lens = torch.arange(keys)[None, :], torch.tensor(seq_lens)[:, None]
        hidden = (pos >= lens) | (pos < lens - window) if window is not None else pos >= lens
        rows = hidden.flatten().nonzero().squeeze(1)
        return host_to_device([rows], device)[0] if rows.numel() else None

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, H_kv, D]
        v: torch.Tensor,  # [T, H_kv, D]
        cache: PagedKVCache,
        plan: PagedPlan,
    ) -> torch.Tensor:
        cache.write(layer_idx, k, v, plan.meta)
        layer = plan.meta.layer(layer_idx)
        if plan.key_mask is not None:
            return self._decode(layer_idx, q, cache, plan, layer)
        return self._prefill(layer_idx, q, k, v, cache, plan, layer)

    @staticmethod
    def _decode(
        layer_idx: int, q: torch.Tensor, cache: PagedKVCache, plan: PagedPlan, layer: LayerAttention
    ) -> torch.Tensor:
        num_seqs, num_heads, d = q.shape
        k, v = cache.gather_blocks(layer_idx, plan.flat_tables)  # [B * MB, block_size, H_kv, D]
        h_kv = k.shape[2]
        hidden = plan.hidden_rows[layer.sliding_window]
        if hidden is not None:  # rows the mask hides hold other requests' K/V (padding: block 0) or stale ones, maybe
            k.view(-1, h_kv, d).index_fill_(0, hidden, 0)  # NaN, which a softmax weight of 0 does not cancel: zeros
            v.view(-1, h_kv, d).index_fill_(0, hidden, 0)  # (the gathered blocks are copies)
        k = k.view(num_seqs, -1, h_kv, d).transpose(1, 2)  # [B, H_kv, keys, D]
        v = v.view(num_seqs, -1, h_kv, d).transpose(1, 2)
        mask = plan.key_mask if layer.sliding_window is None else plan.window_masks[layer.sliding_window]
        if layer.softcap is not None or layer.sinks is not None:
            out = explicit_attention(q.reshape(num_seqs, num_heads, 1, d), k, v, mask, layer)  # [B, H, 1, D]
            return out.reshape(num_seqs, num_heads, d)
        qg = q.view(num_seqs, h_kv, num_heads // h_kv, d)  # [B, H_kv, G, D]
        out = F.scaled_dot_product_attention(qg, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=layer.scale)
        return out.reshape(num_seqs, num_heads, d)

    @staticmethod
    def _prefill(
        layer_idx: int, q, k_new, v_new, cache: PagedKVCache, plan: PagedPlan, layer: LayerAttention
    ) -> torch.Tensor:
        meta = plan.meta
        out = torch.empty_like(q)
        start = 0
        h_kv, d = k_new.shape[1], k_new.shape[2]
        for table, ctx, q_len in zip(plan.tables, meta.context_lens, meta.query_lens):
            seq_len = ctx + q_len
            if ctx == 0 and plan.fresh_from_input:
                k, v = k_new[start : start + q_len], v_new[start : start + q_len]  # [S, H_kv, D]
            else:
                k, v = cache.gather_blocks(layer_idx, table)  # [blocks, block_size, H_kv, D]
            ks = k.reshape(-1, h_kv, d)[:seq_len].transpose(0, 1).to(q.dtype)[None]  # [1, H_kv, S, D]
            vs = v.reshape(-1, h_kv, d)[:seq_len].transpose(0, 1).to(q.dtype)[None]
            qs = q[start : start + q_len].transpose(0, 1)[None]  # [1, H, q_len, D]
            if layer.variants:
                mask, causal = causal_mask(ctx, q_len, q.device, layer.sliding_window), False
            else:  # is_causal aligns top-left: right for a fresh prefill only
                mask, causal = (None, True) if ctx == 0 else (causal_mask(ctx, q_len, q.device), False)
            if layer.softcap is not None or layer.sinks is not None:
                o = explicit_attention(qs, ks, vs, mask, layer)
            else:
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=mask, is_causal=causal, scale=layer.scale, enable_gqa=True
                )
            out[start : start + q_len] = o[0].transpose(0, 1)
            start += q_len
        return out


@hookimpl
def kvcore_register_backends(register):
    register(PagedBackend)


@hookimpl
def kvcore_register_kv_caches(register):
    register(PagedKVCache)
