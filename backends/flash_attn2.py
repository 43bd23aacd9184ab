"""``flash_attn2``: Tri Dao's flash-attn 2.x kernels (CUDA, sm80+, fp16/bf16, head_dim ≤ 256 and a multiple of 8).

Two kernels, one per phase:

* **prefill** (and any call that is not a pure decode step): ``flash_attn_varlen_func`` over the packed
  batch. ``q`` is already packed ``[T, H, D]`` with ``meta.cu_seqlens_q``. The keys are this call's K/V
  when every sequence starts fresh; when some sequence continues a cache (``context_len > 0``) the K/V of
  every sequence are gathered from the cache (cached tokens + this call's, which were written first) into
  ``[sum(seq_lens), H_kv, D]`` with ``cu_seqlens_k`` = prefix sums of ``seq_lens``. ``causal=True`` is
  aligned bottom-right in flash-attn ≥ 2.1, so query ``i`` sits at absolute position ``context_len + i``.
* **decode** (every sequence adds one token to a non-empty cache): ``flash_attn_with_kvcache`` appends
  the new K/V rows *in place* at ``cache_seqlens`` (the lengths **before** the append) and attends, in
  one kernel. ``cache_batch_idx`` maps batch rows to cache slots, so a batch need not be slots 0..B-1.

Attention variants: a layer's sliding window ``W`` is flash-attn's ``window_size = (W - 1, 0)`` (the query
and the ``W - 1`` keys before it), its soft-cap the ``softcap`` argument (flash-attn >= 2.6), its scale
``softmax_scale``; both kernels take them. flash-attn 2 has no attention sinks.

GQA/MQA needs nothing: flash-attn takes fewer KV heads than query heads (query head ``h`` reads KV head
``h // (H / H_kv)``, the same grouping as Llama's).

KV cache: ``flash_attn_with_kvcache`` wants a cache laid out ``[batch, seqlen, H_kv, D]``. The preferred
cache kind ``flash_contiguous`` (:class:`FlashKVCache`, defined here) stores exactly that per layer:
``k[layer]`` is ``[max_num_seqs, max_seq_len, H_kv, D]``. The standard ``contiguous`` cache
(``[max_num_seqs, H_kv, max_seq_len, D]``) is also read, through a transposed view: the kernel only needs
a contiguous last dimension and honours the other strides, so this backend can share a cache with
``naive``/``sdpa`` when phases are split between backends.

Paged KV caches are not supported: flash-attn 2's paged mode needs ``page_block_size`` to be a multiple
of 256 (see docs/gpu-backends.md).

The kernels are reached through ``self.kernels`` — the ``flash_attn`` module, imported on first use.
Tests pass ``kernels=FLASH_KERNELS`` from ``tests/kernel_emulation.py`` to run this exact glue on CPU against
emulations of the documented kernel semantics.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore.hookspecs import hookimpl
from kvcore.interfaces.attention import BackendCapabilities
from kvcore.interfaces.kv_cache import KVCache
from kvcore.interfaces.metadata import AttentionMetadata

from .contiguous import ContiguousKVCache
from .cuda_glue import KernelBackend, SlotPlan, cuda_availability, import_reason, kv_views

__all__ = ["FlashAttn2Backend", "FlashKVCache"]

FLASH_ATTN_INSTALL = "pip install flash-attn --no-build-isolation; see docs/gpu-backends.md"
#: flash-attn 2.8.3's csrc/flash_attn/flash_api.cpp: ``TORCH_CHECK(cc_major >= 8, "FlashAttention only
#: supports Ampere GPUs or newer.")`` (older 2.x releases accepted only sm8x and sm90)
FLASH_MIN_CC = (8, 0)
FLASH_MIN_VERSION = (2, 6)  # flash_attn_with_kvcache with cache_batch_idx / cache_leftpad keywords
#: flash-attn 2.x's compiled kernels: a top-level extension module beside the ``flash_attn`` package. A
#: ``flash_attn`` without it is not flash-attn 2 (flash-attn-4 installs an empty ``flash_attn`` namespace).
FLASH_EXTENSION = "flash_attn_2_cuda"
FLASH_FUNCTIONS = ("flash_attn_varlen_func", "flash_attn_with_kvcache")  # what this backend calls


# -- the flash-layout KV cache ---------------------------------------------------------------------------
class FlashKVCache(ContiguousKVCache):
    """Contiguous per-slot cache in flash-attn's layout: ``k[layer]`` is ``[max_num_seqs, max_seq_len,
    H_kv, D]`` (``[batch, seqlen, nheads_k, headdim]``, what ``flash_attn_with_kvcache`` takes as
    ``k_cache``). A sequence owns one slot for its life; token ``p`` lives at ``k[layer, slot, p]``.
    """

    name = "flash_contiguous"
    layout = "flash_contiguous"
    description = "one slot of max_seq_len tokens per sequence in flash-attn's [L, slots, S, H_kv, D]"
    position_dim = 2

    def storage_shape(self) -> tuple[int, ...]:
        s = self.spec
        return (s.num_layers, self.num_blocks, self.block_size, s.num_kv_heads, s.head_dim)

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        slots = meta.slot_mapping // self.block_size
        self.k[layer_idx, slots, meta.positions] = k  # [T, H_kv, D]
        self.v[layer_idx, slots, meta.positions] = v

    def read(self, layer_idx: int, block_table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        slot = block_table[0] if block_table else 0  # an empty sequence holds no block yet: length is 0
        return self.k[layer_idx, slot, :length].clone(), self.v[layer_idx, slot, :length].clone()


# -- the backend ---------------------------------------------------------------------------------------
def _flash_attn_module() -> Any:
    import flash_attn  # optional, CUDA-only: imported on first use

    return flash_attn


class FlashAttn2Backend(KernelBackend):
    name = "flash_attn2"
    description = "flash-attn 2: varlen prefill, flash_attn_with_kvcache decode (in-place append)"
    priority = 20
    capabilities = BackendCapabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        kv_layouts=("flash_contiguous", "contiguous"),
        max_head_dim=256,
        head_dim_multiple=8,
        supports_gqa=True,
        min_compute_capability=FLASH_MIN_CC,
        prefill_variants=frozenset({"sliding_window", "softcap"}),
        decode_variants=frozenset({"sliding_window", "softcap"}),
    )

    _load_kernels = staticmethod(_flash_attn_module)  # flash_attn_varlen_func, flash_attn_with_kvcache

    @classmethod
    def availability(cls) -> str | None:
        reason = cuda_availability("flash_attn", FLASH_ATTN_INSTALL, FLASH_MIN_CC, extension=FLASH_EXTENSION)
        if reason is None:
            reason = import_reason("flash_attn") or _api_reason()
        return reason

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, H_kv, D]
        v: torch.Tensor,  # [T, H_kv, D]
        cache: KVCache,
        plan: SlotPlan,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_views(cache, layer_idx)  # [slots, S, H_kv, D]
        layer = plan.meta.layer(layer_idx)
        variants = {
            "softmax_scale": layer.scale,
            "window_size": (-1, -1) if layer.sliding_window is None else (layer.sliding_window - 1, 0),
            "softcap": layer.softcap or 0.0,
        }
        if plan.meta.is_decode:
            return self._decode(q, k, v, k_cache, v_cache, plan, variants)
        return self._prefill(layer_idx, q, k, v, cache, k_cache, v_cache, plan, variants)

    def _decode(self, q, k, v, k_cache, v_cache, plan: SlotPlan, variants: dict[str, Any]) -> torch.Tensor:
        out = self.kernels.flash_attn_with_kvcache(
            q.unsqueeze(1),  # [B, 1, H, D]
            k_cache,
            v_cache,
            k=k.unsqueeze(1),  # [B, 1, H_kv, D], appended in place at cache_seqlens
            v=v.unsqueeze(1),
            cache_seqlens=plan.context_lens_i32,  # lengths BEFORE this step's append
            cache_batch_idx=plan.slots_i32,
            causal=True,  # one query row: the kernel treats it as non-causal, it sees every key (in its window)
            **variants,
        )
        return out.squeeze(1)

    def _prefill(self, layer_idx, q, k, v, cache: KVCache, k_cache, v_cache, plan: SlotPlan, variants: dict):
        meta = plan.meta
        cache.write(layer_idx, k, v, meta)
        if plan.gather_slot is None:  # every sequence starts fresh: this call's K/V are all the keys
            keys, values = k, v
            cu_k, max_k = meta.cu_seqlens_q, meta.max_query_len
        else:
            keys = k_cache[plan.gather_slot, plan.gather_pos]  # [sum(seq_lens), H_kv, D]
            values = v_cache[plan.gather_slot, plan.gather_pos]
            cu_k, max_k = plan.cu_seqlens_k, meta.max_seq_len
        return self.kernels.flash_attn_varlen_func(
            q,
            keys,
            values,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=max_k,
            dropout_p=0.0,
            causal=True,  # bottom-right aligned: query i of a sequence is at position context_len + i
            **variants,
        )


def _api_reason() -> str | None:
    """Why the imported ``flash_attn`` is not a flash-attn 2 this backend can call (None: it is)."""
    import flash_attn

    missing = [f for f in FLASH_FUNCTIONS if not callable(getattr(flash_attn, f, None))]
    if missing:
        return f"flash_attn {getattr(flash_attn, '__version__', '?')} has no {', '.join(missing)}"
    try:
        parts = tuple(int(p) for p in str(flash_attn.__version__).split(".")[:2])
    except Exception:
        return None  # no parsable version: the functions are there, let the kernels speak for themselves
    if parts[0] != 2 or parts < FLASH_MIN_VERSION:
        want = ".".join(map(str, FLASH_MIN_VERSION))
        return f"flash_attn {flash_attn.__version__} found; this backend needs flash-attn 2.x >= {want}"
    return None


@hookimpl
def kvcore_register_backends(register):
    register(FlashAttn2Backend)


@hookimpl
def kvcore_register_kv_caches(register):
    register(FlashKVCache)
