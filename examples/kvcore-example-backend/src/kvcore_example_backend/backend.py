"""``example_chunked``: attention over the KV cache in fixed-size key chunks with an online softmax.

For each sequence, keys and values are visited ``chunk_size`` at a time, keeping per query row a
running maximum ``m``, a running normaliser ``l`` and an unnormalised output ``acc`` (the
flash-attention recurrence, in float32)::

    s     = q · k_chunkᵀ · scale      (soft-capped c · tanh(s / c) on a layer with a soft-cap, then masked:
                                       key position > query position, or outside the layer's window → -inf)
    m'    = max(m, rowmax(s))
    p     = exp(s - m')
    l     = l · exp(m - m') + rowsum(p)
    acc   = acc · exp(m - m') + p · v_chunk
    out   = acc / l

Chunks that lie wholly in every query's future are never read. A sequence's query rows may continue its
cache (a prefill chunk, or a speculative verification's last token and drafts: ``multi_token_decode``), each
row masked to its own position. Attention variants: the layer's
(``meta.layer(layer_idx)``) sliding window and soft-cap, in both phases; no sinks (declared in
``capabilities``, so a model with sinks is refused with the reason instead of run wrong).

GQA: query head ``h`` reads KV head ``h // (H / H_kv)``; the group's query heads are stacked as rows of
one matmul per KV head, so K/V are never repeated.

It reads two KV-cache layouts (``BackendCapabilities.kv_layouts``), preferring the first:

* ``contiguous``: ``cache.k[layer, slot, :, :seq_len]``, a view (no copy) of the sequence's slot, the
  slot being the first (only) entry of its block table;
* ``paged``: only through ``cache.gather_blocks(layer, block_ids)``, so every layout-"paged" cache
  serves it unchanged, whatever it stores (``paged``, ``int8``, this package's ``example_fp16``).

The backend keeps no per-call plan of its own: :meth:`~kvcore.AttentionBackend.plan` returns the
:class:`~kvcore.AttentionMetadata` itself. The small methods below are the seams a subclass (or a test
planting a bug) can override.
"""

from __future__ import annotations

import math

import torch

from kvcore import AttentionBackend, AttentionMetadata, BackendCapabilities, KVCache
from kvcore.errors import ConfigError
from kvcore.interfaces.layer_attention import LayerAttention

__all__ = ["ChunkedAttentionBackend"]


class ChunkedAttentionBackend(AttentionBackend[AttentionMetadata]):
    name = "example_chunked"
    description = "example plugin: chunked-KV online-softmax attention (plain PyTorch)"
    priority = -10  # never picked automatically over the built-ins
    capabilities = BackendCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
        kv_layouts=("contiguous", "paged"),
        max_head_dim=256,
        prefill_variants=frozenset({"sliding_window", "softcap"}),
        decode_variants=frozenset({"sliding_window", "softcap"}),
        multi_token_decode=True,  # rows of several tokens after a cache are masked per position, as in prefill
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
        """Store this call's K/V; the cache knows where (``meta.slot_mapping``)."""
        cache.write(layer_idx, k, v, meta)

    def sequence_kv(
        self, layer_idx: int, cache: KVCache, meta: AttentionMetadata, i: int, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the ``i``-th sequence of the call, ``[H_kv, seq_len, D]`` each."""
        table = self.physical_blocks(meta.block_tables[i])
        if cache.layout == "contiguous":
            slot = table[0]  # a per-sequence layout: the one block is the sequence's slot
            return cache.k[layer_idx, slot, :, :seq_len], cache.v[layer_idx, slot, :, :seq_len]
        if cache.layout == "paged":
            num_blocks = math.ceil(seq_len / cache.block_size)
            ids = torch.tensor(table[:num_blocks], dtype=torch.long, device=meta.positions.device)
            k, v = cache.gather_blocks(layer_idx, ids)  # [n, block_size, H_kv, D], in the model dtype
            h_kv, d = k.shape[2], k.shape[3]
            k = k.reshape(-1, h_kv, d)[:seq_len].transpose(0, 1)  # [H_kv, seq_len, D]
            v = v.reshape(-1, h_kv, d)[:seq_len].transpose(0, 1)
            return k, v
        raise ConfigError(
            f"backend 'example_chunked' cannot read KV cache '{cache.name}' (layout '{cache.layout}'; "
            f"reads: {', '.join(self.capabilities.kv_layouts)})"
        )

    def physical_blocks(self, table: list[int]) -> list[int]:
        """Block-table entries → physical block ids (the identity here)."""
        return table

    def visible(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """``[n, c]`` mask: query at ``query_pos[i]`` may attend to the key at ``key_pos[j]``."""
        return key_pos[None, :] <= query_pos[:, None]

    def in_window(self, query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
        """``[n, c]`` mask: the key is one of the ``window`` last positions up to the query's (its own included)."""
        return key_pos[None, :] > query_pos[:, None] - window

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
    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, H_kv, D]
        v: torch.Tensor,  # [T, H_kv, D]
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        self.write_kv(layer_idx, k, v, cache, meta)
        num_heads, head_dim = q.shape[1], q.shape[2]
        scale = self.softmax_scale(meta, head_dim)
        layer = meta.layer(layer_idx)
        out = torch.empty_like(q)
        starts = meta.query_starts  # host list: no device sync per layer
        for i, (ctx, n) in enumerate(zip(meta.context_lens, meta.query_lens)):
            seq_len = ctx + n
            keys, values = self.sequence_kv(layer_idx, cache, meta, i, seq_len)  # [H_kv, S, D]
            qi = q[starts[i] : starts[i + 1]]  # [n, H, D]
            o = self._attend(self.group_queries(qi.float(), keys.shape[0]), keys, values, ctx, n, scale, layer)
            out[starts[i] : starts[i + 1]] = self.ungroup(o, num_heads).to(q.dtype)
        return out

    def _attend(
        self, qg, keys, values, ctx: int, n: int, scale: float, layer: LayerAttention | None = None
    ) -> torch.Tensor:
        """``qg`` ``[H_kv, G·n, D]`` float32 over ``keys``/``values`` ``[H_kv, S, D]`` → ``[H_kv, G·n, D]``,
        with ``layer``'s window and soft-cap (None: plain causal)."""
        window = layer.sliding_window if layer is not None else None
        softcap = layer.softcap if layer is not None else None
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
            if softcap is not None:  # before the mask: a capped -inf would be a visible -c
                s = torch.tanh(s / softcap) * softcap
            key_pos = torch.arange(c0, c1, device=device)
            mask = self.visible(query_pos, key_pos)  # [rows, c]
            if window is not None:
                mask = mask & self.in_window(query_pos, key_pos, window)
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
