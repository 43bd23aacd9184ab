"""``naive``: the reference backend, the textbook algorithm written out literally.

Per head: ``S = Q Kᵀ · scale`` (the model's softmax scale, ``1 / √d_h`` for Llama); in prefill the
causal mask sets ``S[i, j] = -∞`` where key ``j`` lies in query ``i``'s future; ``P = softmax(S)``;
``O = P V``. Query head ``h`` reads KV head ``h // (H / H_kv)`` (GQA). K/V rows are written into the
preallocated contiguous cache at their positions, never concatenated. Computed in float32 whatever the
model dtype: this is the oracle every other backend is tested against, so clarity beats speed here.
"""

from __future__ import annotations

import torch

from kvcore.hookspecs import hookimpl
from kvcore.interfaces.attention import AttentionBackend, BackendCapabilities, causal_mask
from kvcore.interfaces.metadata import AttentionMetadata

from .contiguous import ALL_DTYPES, ContiguousKVCache


class NaiveBackend(AttentionBackend[AttentionMetadata]):
    name = "naive"
    description = "reference: explicit QKᵀ/√d, −∞ causal mask, softmax, ·V in float32"
    priority = 0
    capabilities = BackendCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=ALL_DTYPES,
        kv_layouts=("contiguous",),
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
        # Step 1: append this call's K/V rows at their positions in the preallocated cache.
        cache.write(layer_idx, k, v, meta)

        num_heads = q.shape[1]
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        kv_head_of = torch.arange(num_heads, device=q.device) // group  # query head h → KV head h // group
        out = torch.empty_like(q)
        starts = meta.query_starts  # a host list: no device sync per layer
        for i, (slot, ctx, q_len) in enumerate(zip(meta.slots, meta.context_lens, meta.query_lens)):
            seq_len = ctx + q_len
            Q = q[starts[i] : starts[i + 1]].transpose(0, 1).float()  # (H, q_len, D)
            K = cache.k[layer_idx, slot, :, :seq_len].float()[kv_head_of]  # (H, seq_len, D)
            V = cache.v[layer_idx, slot, :, :seq_len].float()[kv_head_of]  # (H, seq_len, D)

            S = Q @ K.transpose(-2, -1) * meta.scale  # (H, q_len, seq_len); scale = 1/√d_h for Llama
            if q_len > 1:
                # Prefill: query row i sits at absolute position ctx + i and may see keys 0..ctx+i.
                S = S.masked_fill(~causal_mask(ctx, q_len, q.device), float("-inf"))
            # Decode (q_len == 1): the query is the newest token, every cached key is in its past: no mask.
            P = torch.softmax(S, dim=-1)  # (H, q_len, seq_len)
            O = P @ V  # (H, q_len, D)
            out[starts[i] : starts[i + 1]] = O.transpose(0, 1).to(q.dtype)  # (q_len, H, D)
        return out


@hookimpl
def kvcore_register_backends(register):
    register(NaiveBackend)
