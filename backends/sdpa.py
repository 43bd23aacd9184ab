"""``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` over the contiguous cache.

On CPU this runs PyTorch's fused flash-attention kernel. Two details matter:

* SDPA's ``is_causal`` aligns the mask top-left. That is right only when the query covers the whole
  key range (a fresh prefill). A prefill that continues a cache needs the mask aligned bottom-right
  (query ``i`` at absolute position ``context_len + i``), so we pass an explicit boolean mask then.
* GQA is handled by the kernel (``enable_gqa=True``): K/V keep ``H_kv`` heads, nothing is repeated.

Everything read from the cache is a view (no copy, no concatenation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcore.attention import AttentionBackend, AttentionMetadata, BackendCapabilities
from kvcore.hookspecs import hookimpl
from kvcore.kv_cache import ContiguousKVCache


class SDPABackend(AttentionBackend):
    name = "sdpa"
    description = "torch scaled_dot_product_attention (fused kernels), contiguous cache"
    priority = 10
    capabilities = BackendCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        cache_kinds=("contiguous",),
    )

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, H_kv, D]
        v: torch.Tensor,  # [T, H_kv, D]
        cache: ContiguousKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cache.write(layer_idx, k, v, meta)
        k_cache, v_cache = cache.k[layer_idx], cache.v[layer_idx]  # [S, H_kv, max_len, D]
        slots = meta.cache_meta.slots
        if meta.is_decode and slots == list(range(slots[0], slots[0] + len(slots))):
            return self._decode_batched(q, k_cache, v_cache, meta, slots[0])
        out = torch.empty_like(q)
        starts = meta.cu_seqlens_q.tolist()
        for i, (slot, ctx, q_len) in enumerate(zip(slots, meta.context_lens, meta.query_lens)):
            seq_len = ctx + q_len
            qi = q[starts[i] : starts[i + 1]].transpose(0, 1).unsqueeze(0)  # (1, H, q_len, D)
            ki = k_cache[slot, :, :seq_len].unsqueeze(0)  # (1, H_kv, seq_len, D) view
            vi = v_cache[slot, :, :seq_len].unsqueeze(0)
            mask, causal = None, False
            if q_len > 1 and ctx == 0:
                causal = True  # square: top-left and bottom-right alignment coincide
            elif q_len > 1:
                query_pos = torch.arange(ctx, seq_len, device=q.device)[:, None]
                mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos  # (q_len, seq_len) bottom-right
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, is_causal=causal, scale=meta.scale, enable_gqa=True
            )  # (1, H, q_len, D)
            out[starts[i] : starts[i + 1]] = oi[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode_batched(q, k_cache, v_cache, meta: AttentionMetadata, first_slot: int) -> torch.Tensor:
        """One kernel call for a decode batch whose sequences occupy consecutive cache slots."""
        num_seqs, max_len = meta.num_seqs, meta.max_seq_len
        ks = k_cache[first_slot : first_slot + num_seqs, :, :max_len]  # (B, H_kv, max_len, D) view
        vs = v_cache[first_slot : first_slot + num_seqs, :, :max_len]
        qs = q.unsqueeze(2)  # (B, H, 1, D)
        mask = None
        if min(meta.context_lens) + 1 != max_len:  # ragged: hide each row's keys past its length
            key_pos = torch.arange(max_len, device=q.device)
            mask = (key_pos[None, :] < meta.seq_lens_t[:, None]).view(num_seqs, 1, 1, max_len)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=meta.scale, enable_gqa=True)
        return out.squeeze(2)  # (B, H, D)


@hookimpl
def kvcore_register_backends(register):
    register(SDPABackend)
