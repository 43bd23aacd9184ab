"""``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` over the contiguous cache.

On CPU this runs PyTorch's fused flash-attention kernel. Details that matter:

* SDPA's ``is_causal`` aligns the mask top-left. That is right only when the query covers the whole
  key range (a fresh prefill). A prefill that continues a cache needs the mask aligned bottom-right
  (query ``i`` at absolute position ``context_len + i``), so we pass an explicit boolean mask then.
* GQA never repeats K/V. Prefill uses the kernel's ``enable_gqa=True``; decode lays the ``H / H_kv``
  query heads of a group out as that KV head's query rows (``q.view(B, H_kv, G, D)``): a small matmul per
  KV head instead of the kernel's broadcast over one query row, which is slow on CPU in bfloat16.
* Per-call work (the cache rows each token's K/V go to, the decode key-padding mask) is planned once per
  forward call in :meth:`SDPABackend.plan`; every layer then does one ``index_copy_`` per K and V and
  one attention call.
* The decode path touches only the plan's tensors and ints and the cache's ``k_rows`` / ``v_rows``, so
  ``torch.compile`` can trace it (``capabilities.compilable``; see :mod:`kvcore.execution.compile`).
* Attention variants (:class:`~kvcore.interfaces.layer_attention.LayerAttention`): a sliding window is an
  explicit boolean mask (planned once per window for decode); soft-capping and sinks have no SDPA argument, so
  those layers run :func:`~kvcore.interfaces.attention.explicit_attention` over the same cache views and
  masks.

Everything read from the cache is a view (no copy, no concatenation): a decode step reads exactly the
live ``[:max_seq_len]`` prefix of each slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcore.hookspecs import hookimpl
from kvcore.interfaces.attention import AttentionBackend, BackendCapabilities, causal_mask, explicit_attention
from kvcore.interfaces.layer_attention import VARIANTS, LayerAttention
from kvcore.interfaces.metadata import AttentionMetadata, host_to_device

from .contiguous import ALL_DTYPES, ContiguousKVCache


@dataclass(frozen=True)
class SDPAPlan:
    """What every layer of one forward call shares."""

    meta: AttentionMetadata
    rows: torch.Tensor  # [L, T * H_kv] row of each (layer, token, KV head) in the cache's k_rows / v_rows
    decode_slot: int | None  # first slot of a decode batch on consecutive slots (one kernel call), else None
    decode_len: int = 0  # keys each decode row reads (max seq_len of the batch)
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, decode_len] additive key-padding mask (ragged batch)
    #: sliding window -> [B, 1, 1, decode_len] bool, True for the keys inside each row's window (and length)
    window_masks: dict[int, torch.Tensor] | None = None


class SDPABackend(AttentionBackend[SDPAPlan]):
    name = "sdpa"
    description = "torch scaled_dot_product_attention (fused kernels), contiguous cache"
    priority = 10
    capabilities = BackendCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=ALL_DTYPES,
        kv_layouts=("contiguous",),
        compilable=True,
        prefill_variants=frozenset(VARIANTS),
        decode_variants=frozenset(VARIANTS),
        multi_token_decode=True,  # several-token rows take the chunked-prefill path
    )

    def plan(self, meta: AttentionMetadata, cache: ContiguousKVCache) -> SDPAPlan:
        num_layers, _, num_kv_heads, max_len, _ = cache.storage_shape()
        # row of (layer l, token t, KV head h): l * layer_rows + (slot_t * H_kv + h) * max_len + position_t; the
        # tokens' part from the host lists in one tensor (as tensor ops it is a dispatch per op)
        per_slot, bs = num_kv_heads * max_len, cache.block_size
        token_rows = torch.tensor([t[p // bs] * per_slot + p for t, c, q in
                                   zip(meta.block_tables, meta.context_lens, meta.query_lens) for p in range(c, c + q)],
                                  dtype=torch.int64)
        (token_rows,) = host_to_device([token_rows], meta.positions.device)
        rows = self._row_bases(cache, meta.positions.device) + token_rows.view(1, -1, 1)  # [L, T, H_kv]
        rows = rows.view(num_layers, -1)  # [L, T * H_kv]
        slots = meta.slots
        if not (meta.is_decode and slots == list(range(slots[0], slots[0] + len(slots)))):
            return SDPAPlan(meta, rows, None)
        windows = {layer.sliding_window for layer in meta.layers} - {None}
        return SDPAPlan(meta, rows, slots[0], meta.max_seq_len, self._decode_mask(meta, cache.spec.dtype),
                        {w: self._window_mask(meta, w) for w in windows})

    def _row_bases(self, cache: ContiguousKVCache, device: torch.device) -> torch.Tensor:
        """``[L, 1, H_kv]`` int64 ``l * layer_rows + h * max_len``: the part of every cache row a step does not
        change, made once per cache (a plan then adds each token's own part)."""
        shape = cache.storage_shape()
        key = (shape, device)
        if getattr(self, "_bases", (None,))[0] != key:
            num_layers, num_slots, num_kv_heads, max_len, _ = shape
            layers = torch.arange(num_layers, device=device)[:, None] * (num_slots * num_kv_heads * max_len)
            self._bases = (key, (layers + torch.arange(num_kv_heads, device=device)[None, :] * max_len)[:, None, :])
        return self._bases[1]

    @staticmethod
    def _window_mask(meta: AttentionMetadata, window: int) -> torch.Tensor:
        """``[B, 1, 1, max_seq_len]`` bool: the keys ``seq_len - window .. seq_len - 1`` of each decode row."""
        keys = torch.arange(meta.max_seq_len, device=meta.positions.device)[None, :]
        lens = meta.seq_lens_t[:, None]
        return ((keys < lens) & (keys >= lens - window)).view(meta.num_seqs, 1, 1, meta.max_seq_len)

    @staticmethod
    def _decode_mask(meta: AttentionMetadata, dtype: torch.dtype) -> torch.Tensor | None:
        """``[B, 1, 1, max_seq_len]`` additive mask hiding each row's keys past its length (None: not ragged)."""
        max_len = meta.max_seq_len
        if min(meta.context_lens) + 1 == max_len:
            return None
        device = meta.positions.device
        valid = torch.arange(max_len, device=device)[None, :] < meta.seq_lens_t[:, None]
        mask = torch.zeros(valid.shape, dtype=dtype, device=device).masked_fill_(~valid, float("-inf"))
        return mask.view(meta.num_seqs, 1, 1, max_len)

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, H_kv, D]
        v: torch.Tensor,  # [T, H_kv, D]
        cache: ContiguousKVCache,
        plan: SDPAPlan,
    ) -> torch.Tensor:
        meta = plan.meta
        d = k.shape[-1]
        # The cache's write as two index_copy_ calls over rows planned once for all layers.
        rows = plan.rows[layer_idx]
        cache.k_rows.index_copy_(0, rows, k.reshape(-1, d))
        cache.v_rows.index_copy_(0, rows, v.reshape(-1, d))
        shape = cache.storage_shape()
        k_cache, v_cache = cache.k_rows.view(shape)[layer_idx], cache.v_rows.view(shape)[layer_idx]  # [S, H_kv, S, D]
        layer = meta.layer(layer_idx)
        if plan.decode_slot is not None:
            return self._decode_batched(q, k_cache, v_cache, plan, layer)
        starts = meta.query_starts  # a host list: no device sync per layer
        outs = [
            self._prefill_attend(q[starts[i] : starts[i + 1]], k_cache[slot, :, : ctx + q_len],
                                 v_cache[slot, :, : ctx + q_len], ctx, layer)
            for i, (slot, ctx, q_len) in enumerate(zip(meta.slots, meta.context_lens, meta.query_lens))
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs)  # one sequence: its output as it is, no copy

    def _prefill_attend(self, q, k, v, context_len: int, layer: LayerAttention) -> torch.Tensor:
        """One sequence's query rows ``q [q_len, H, D]`` (positions ``context_len ..``) against its cache views
        ``k``/``v [H_kv, context_len + q_len, D]``, causal, as ``layer`` attends -> ``[q_len, H, D]``."""
        q_len = q.shape[0]
        mask, causal = None, False
        if layer.variants:
            mask = causal_mask(context_len, q_len, q.device, layer.sliding_window)
        elif q_len > 1 and context_len == 0:
            causal = True  # square: top-left and bottom-right alignment coincide
        elif q_len > 1:
            mask = causal_mask(context_len, q_len, q.device)  # SDPA's is_causal would align it top-left
        qs, ks, vs = q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)  # (1, H, q_len, D), (1, H_kv, S, D)
        if layer.softcap is not None or layer.sinks is not None:
            out = explicit_attention(qs, ks, vs, mask, layer)
        else:
            out = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, is_causal=causal, scale=layer.scale, enable_gqa=True
            )  # (1, H, q_len, D)
        return out[0].transpose(0, 1)

    def _decode_batched(self, q, k_cache, v_cache, plan: SDPAPlan, layer: LayerAttention) -> torch.Tensor:
        """One kernel call for a decode batch whose sequences occupy consecutive cache slots."""
        num_seqs, num_heads, head_dim = q.shape
        first, max_len = plan.decode_slot, plan.decode_len
        ks = k_cache[first : first + num_seqs, :, :max_len]  # (B, H_kv, max_len, D) view
        vs = v_cache[first : first + num_seqs, :, :max_len]
        num_kv_heads = ks.shape[1]
        qs = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # (B, H_kv, G, D): group = rows
        return self._decode_attend(qs, ks, vs, plan, layer).reshape(num_seqs, num_heads, head_dim)

    @staticmethod
    def _decode_attend(qs, ks, vs, plan: SDPAPlan, layer: LayerAttention) -> torch.Tensor:
        """``qs [B, H_kv, G, D]`` against the cache views ``ks``/``vs [B, H_kv, max_len, D]`` -> ``[B, H_kv, G, D]``."""
        mask = plan.window_masks[layer.sliding_window] if layer.sliding_window is not None else plan.decode_mask
        if layer.softcap is not None or layer.sinks is not None:
            b, h_kv, g, d = qs.shape
            out = explicit_attention(qs.reshape(b, h_kv * g, 1, d), ks, vs, mask, layer)  # (B, H, 1, D)
            return out.view(b, h_kv, g, d)
        return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=layer.scale)


@hookimpl
def kvcore_register_backends(register):
    register(SDPABackend)
