"""``example_chunked``: attention over the KV cache in fixed-size key chunks with an online softmax.

For each sequence, keys and values are visited ``chunk_size`` at a time, keeping per query row a
running maximum ``m``, a running normaliser ``l`` and an unnormalised output ``acc`` (the
flash-attention recurrence, in float32)::

    s     = q · k_chunkᵀ · scale      (masked: key position > query position → -inf)
    m'    = max(m, rowmax(s))
    p     = exp(s - m')
    l     = l · exp(m - m') + rowsum(p)
    acc   = acc · exp(m - m') + p · v_chunk
    out   = acc / l

Chunks that lie wholly in every query's future are never read. GQA: query head ``h`` reads KV head
``h // (H / H_kv)``; the group's query heads are stacked as rows of one matmul per KV head, so K/V
are never repeated.

It reads two cache layouts, both built into kvcore: ``contiguous`` (preferred) and ``paged``
(through the sequence's block table). The small methods below are the seams a subclass (or a
test planting a bug) can override.
"""

from __future__ import annotations

import math

import torch

from kvcore import AttentionBackend, AttentionMetadata, BackendCapabilities, KVCache
from kvcore.errors import ConfigError


class ChunkedAttentionBackend(AttentionBackend):
    name = "example_chunked"
    description = "example plugin: chunked-KV online-softmax attention (plain PyTorch)"
    priority = -10  # never picked automatically over the built-ins
    capabilities = BackendCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
        cache_kinds=("contiguous", "paged"),
        max_head_dim=256,
    )

    def __init__(self, chunk_size: int = 64, **options) -> None:
        super().__init__(**options)  # rejects unknown options
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
            raise ConfigError(f"backend 'example_chunked': chunk_size must be a positive integer, got {chunk_size!r}")
        self.chunk_size = chunk_size

    # -- seams ---------------------------------------------------------------------------------------
    def softmax_scale(self, meta: AttentionMetadata, head_dim: int) -> float:
        return meta.scale

    def write_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata):
        """Append this call's K/V (the cache knows where: positions, slots, slot mapping)."""
        cache.write(layer_idx, k, v, meta)

    def sequence_kv(self, layer_idx: int, cache: KVCache, meta: AttentionMetadata, i: int, seq_len: int):
        """K and V of the ``i``-th sequence of the call, ``[H_kv, seq_len, D]`` each."""
        if cache.kind == "contiguous":
            slot = meta.cache_meta.slots[i]
            return cache.k[layer_idx, slot, :, :seq_len], cache.v[layer_idx, slot, :, :seq_len]
        if cache.kind == "paged":
            table = self.physical_blocks(meta.cache_meta.tables[i])
            idx = torch.as_tensor(table, dtype=torch.long, device=cache.k_pool.device)
            h_kv, d = cache.spec.num_kv_heads, cache.spec.head_dim
            k = cache.k_pool[layer_idx][idx].reshape(-1, h_kv, d)[:seq_len].transpose(0, 1)
            v = cache.v_pool[layer_idx][idx].reshape(-1, h_kv, d)[:seq_len].transpose(0, 1)
            return k, v
        raise ConfigError(f"backend 'example_chunked' cannot read a '{cache.kind}' KV cache")

    def physical_blocks(self, table: list[int]) -> list[int]:
        """Block-table entries → physical block ids (the identity here)."""
        return table

    def visible(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """``[n, c]`` mask: query at ``query_pos[i]`` may attend to the key at ``key_pos[j]``."""
        return key_pos[None, :] <= query_pos[:, None]

    def group_queries(self, q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        """``[n, H, D]`` → ``[H_kv, G·n, D]``: KV head ``j`` gets query heads ``j·G … j·G+G-1``."""
        n, h, d = q.shape
        g = h // num_kv_heads
        return q.transpose(0, 1).reshape(num_kv_heads, g * n, d)

    def ungroup(self, o: torch.Tensor, num_heads: int) -> torch.Tensor:
        """Inverse of :meth:`group_queries`: ``[H_kv, G·n, D]`` → ``[n, H, D]``."""
        h_kv, rows, d = o.shape
        return o.reshape(num_heads, rows // (num_heads // h_kv), d).transpose(0, 1)

    # -- the algorithm -------------------------------------------------------------------------------
    def forward(self, layer_idx, q, k, v, cache, meta):
        self.write_kv(layer_idx, k, v, cache, meta)
        num_heads, head_dim = q.shape[1], q.shape[2]
        scale = self.softmax_scale(meta, head_dim)
        out = torch.empty_like(q)
        starts = meta.cu_seqlens_q.tolist()
        for i, (ctx, n) in enumerate(zip(meta.context_lens, meta.query_lens)):
            seq_len = ctx + n
            keys, values = self.sequence_kv(layer_idx, cache, meta, i, seq_len)  # [H_kv, S, D]
            qi = q[starts[i] : starts[i + 1]]  # [n, H, D]
            o = self._attend(self.group_queries(qi.float(), keys.shape[0]), keys, values, ctx, n, scale)
            out[starts[i] : starts[i + 1]] = self.ungroup(o, num_heads).to(q.dtype)
        return out

    def _attend(self, qg, keys, values, ctx: int, n: int, scale: float) -> torch.Tensor:
        h_kv, rows, d = qg.shape
        device = qg.device
        group = rows // n
        query_pos = (ctx + torch.arange(n, device=device)).repeat(group)  # row r is token r % n
        m = torch.full((h_kv, rows), -math.inf, device=device)
        l = torch.zeros((h_kv, rows), device=device)
        acc = torch.zeros((h_kv, rows, d), device=device)
        seq_len = keys.shape[1]
        last_visible = ctx + n - 1
        for c0 in range(0, seq_len, self.chunk_size):
            if c0 > last_visible:
                break  # every remaining key is in every query's future
            c1 = min(c0 + self.chunk_size, seq_len)
            kc, vc = keys[:, c0:c1].float(), values[:, c0:c1].float()  # [H_kv, c, D]
            s = (qg @ kc.transpose(1, 2)) * scale  # [H_kv, rows, c]
            mask = self.visible(query_pos, torch.arange(c0, c1, device=device))  # [rows, c]
            s = s.masked_fill(~mask, -math.inf)
            m_new = torch.maximum(m, s.amax(dim=-1))
            # rows with nothing visible yet keep m = -inf; exp(-inf - -inf) would be nan, so pin them
            safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - safe[..., None])
            correction = torch.exp(m - safe)
            l = l * correction + p.sum(dim=-1)
            acc = acc * correction[..., None] + p @ vc
            m = m_new
        return acc / l[..., None]
