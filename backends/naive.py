"""``naive``: the reference backend, the textbook algorithm written out literally.

Per head: ``S = Q Kᵀ · scale`` (the layer's softmax scale, ``1 / √d_h`` for Llama); with a soft-cap
``c``, ``S = c · tanh(S / c)``; the causal mask sets ``S[i, j] = -∞`` where key ``j`` lies in query ``i``'s
future or, with a sliding window ``W``, ``W`` or more positions in its past; with sinks, each head's sink
logit joins the softmax as one more column that weights no value; ``P = softmax(S)``; ``O = P V``.
Every :class:`~kvcore.interfaces.attention.LayerAttention` variant, in both phases, registered ones included: their
``score_mod`` / ``mask_mod`` (:mod:`kvcore.interfaces.variants`) are evaluated densely, after the soft-cap, on
index tensors that broadcast against ``S``. Query head ``h`` reads KV head
``h // (H / H_kv)`` (GQA). K/V rows are written into the preallocated contiguous cache at their positions,
never concatenated. Computed in float32 whatever the
model dtype: this is the oracle every other backend is tested against, so clarity beats speed here.
"""

from __future__ import annotations

import torch

from kvcore.hookspecs import hookimpl
from kvcore.interfaces.attention import AttentionBackend, BackendCapabilities, causal_mask
from kvcore.interfaces.layer_attention import VARIANTS
from kvcore.interfaces.metadata import AttentionMetadata
from kvcore.interfaces.variants import apply_mods

from .contiguous import ALL_DTYPES, ContiguousKVCache


class NaiveBackend(AttentionBackend[AttentionMetadata]):
    name = "naive"
    description = "reference: explicit QKᵀ/√d, −∞ causal mask, softmax, ·V in float32"
    priority = 0
    capabilities = BackendCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=ALL_DTYPES,
        kv_layouts=("contiguous",),
        prefill_variants=frozenset(VARIANTS),
        decode_variants=frozenset(VARIANTS),
        variants_as_code=True,  # the oracle of every registered variant is the variant itself
        multi_token_decode=True,  # several-token rows take the chunked-prefill path
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
        layer = meta.layer(layer_idx)

        num_heads = q.shape[1]
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        heads = torch.arange(num_heads, device=q.device)
        kv_head_of = heads // group  # query head h → KV head h // group
        out = torch.empty_like(q)
        starts = meta.query_starts  # a host list: no device sync per layer
        for i, (slot, ctx, q_len) in enumerate(zip(meta.slots, meta.context_lens, meta.query_lens)):
            seq_len = ctx + q_len
            Q = q[starts[i] : starts[i + 1]].transpose(0, 1).float()  # (H, q_len, D)
            K = cache.k[layer_idx, slot, :, :seq_len].float()[kv_head_of]  # (H, seq_len, D)
            V = cache.v[layer_idx, slot, :, :seq_len].float()[kv_head_of]  # (H, seq_len, D)

            S = Q @ K.transpose(-2, -1) * layer.scale  # (H, q_len, seq_len); scale = 1/√d_h for Llama
            if layer.softcap is not None:  # before the mask: capped, a masked -∞ would become -c, a visible key
                S = torch.tanh(S / layer.softcap) * layer.softcap
            # Query row i sits at absolute position ctx + i and may see keys 0..ctx+i (the last
            # sliding_window of them on a windowed layer). In decode that is every cached key, or the window.
            visible = causal_mask(ctx, q_len, q.device, layer.sliding_window)  # (q_len, seq_len)
            if layer.mods:  # registered variants: after the soft-cap, before the mask (which they can only narrow)
                q_pos = torch.arange(ctx, seq_len, device=q.device)
                kv_pos = torch.arange(seq_len, device=q.device)
                S, visible = apply_mods(layer.mods, S, visible, torch.tensor(i, device=q.device),
                                        heads[:, None, None], q_pos[None, :, None], kv_pos[None, None, :])
            S = S.masked_fill(~visible, float("-inf"))
            if layer.sinks is not None:  # one more logit per head in the softmax, weighting no value
                sink = layer.sinks.float().to(q.device)[:, None, None].expand(num_heads, q_len, 1)
                P = torch.softmax(torch.cat([S, sink], dim=-1), dim=-1)[..., :seq_len]
            else:
                P = torch.softmax(S, dim=-1)  # (H, q_len, seq_len)
            O = P @ V  # (H, q_len, D)
            out[starts[i] : starts[i + 1]] = O.transpose(0, 1).to(q.dtype)  # (q_len, H, D)
        return out


@hookimpl
def kvcore_register_backends(register):
    register(NaiveBackend)
