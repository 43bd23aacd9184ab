"""``xformers``: ``xformers.ops.memory_efficient_attention`` (CUDA only; fp16/bf16, and fp32 up to sm90
through its CUTLASS kernel).

One kernel call per layer for the whole ragged batch, prefill and decode alike:

* Queries are packed along M: ``[1, T, ...]``.
* **Fresh prefill** (every ``context_len == 0``): keys are this call's packed K/V and the bias is
  ``BlockDiagonalCausalMask.from_seqlens(query_lens)`` (top-left causal per sequence, which equals
  bottom-right when queries and keys coincide). Nothing is read back from the cache.
* **Otherwise** (decode, or a prefill continuing a cache): keys come from the cache in blocks of
  ``kv_padding`` rows, one block per sequence, and the bias is
  ``BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(q_seqlen=query_lens, kv_padding=pad,
  kv_seqlen=seq_lens)``: each sequence sees only its first ``seq_len`` keys, causally aligned
  bottom-right (query ``i`` at absolute position ``context_len + i``). A decode step is the same mask
  with ``query_len == 1``. When the batch occupies consecutive slots of the ``flash_contiguous`` cache the
  blocks are a *view* of the cache (``kv_padding = max_seq_len``, no copy); otherwise the used rows are
  gathered into blocks of ``kv_padding = max(seq_lens)``.
* **fp16/bf16 on a ``flash_contiguous`` cache** (sm80+, where xformers' FlashAttention operators serve
  them): the keys are the whole cache layer as one view ``[1, slots * max_seq_len, H_kv, D]`` and the bias
  is ``BlockDiagonalCausalWithOffsetGappyKeysMask.from_seqlens(q_seqlen=query_lens, kv_seqstarts=[slot *
  max_seq_len ...] + [slots * max_seq_len], kv_seqlen=seq_lens)``: each sequence's keys are read where
  they lie, in any slot order, with no copy. fp32 has only cutlassF, which takes no gappy bias.
* **GQA/MQA** uses xformers' 5-D ``[B, M, G, H, K]`` layout: ``G = H_kv`` groups of ``H / H_kv`` query
  heads; K/V are ``[B, M, G, 1, K]`` *expanded* (stride 0, no copy) to ``[B, M, G, H/H_kv, K]``, since
  xformers does not broadcast by itself. Query head ``g * (H / H_kv) + j`` reads KV head ``g``, Llama's
  grouping. Plain MHA uses the 4-D ``[B, M, H, K]`` layout.

Cache kinds: ``flash_contiguous`` (shared with ``flash_attn2``; ``[slots, S, H_kv, D]`` per layer, which
allows the zero-copy path) and ``contiguous`` (read through a transposed view, always gathered).

The kernels are reached through ``self.kernels`` (xformers' ``memory_efficient_attention`` and the three
bias classes), imported on first use; tests pass ``kernels=XFORMERS_KERNELS`` from ``tests/kernel_emulation.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from kvcore.hookspecs import hookimpl
from kvcore.interfaces.attention import BackendCapabilities
from kvcore.interfaces.kv_cache import KVCache
from kvcore.interfaces.metadata import AttentionMetadata

from .cuda_glue import KernelBackend, SlotPlan, cuda_availability, kv_views, slot_plan

__all__ = ["XFormersBackend", "XFormersPlan"]

XFORMERS_INSTALL = "pip install --no-deps xformers==0.0.35 to keep your torch; see docs/gpu-backends.md"
#: xformers' docs: "NVIDIA GPUs with compute capability above 6.0 (P100+)"
XFORMERS_MIN_CC = (6, 0)
#: xformers 0.0.35's forward operators: bf16 needs sm80 (every kernel family); float32 has one operator,
#: cutlassF (``CUDA_MAXIMUM_COMPUTE_CAPABILITY = (9, 0)``): fa2F, fa3F and the Blackwell CUTLASS kernel
#: take fp16/bf16 only, so sm100+ has no float32 operator
XFORMERS_DTYPE_CC = ((torch.bfloat16, (8, 0), None), (torch.float32, (6, 0), (9, 0)))


@dataclass(frozen=True)
class XFormersPlan:
    """What every layer of one call shares: the slot plan, the attention bias (built once per step) and
    where the keys come from."""

    slots: SlotPlan
    bias: Any  # BlockDiagonalCausalMask or BlockDiagonalCausalWithOffset{Padded,Gappy}KeysMask
    keys: str = "input"  # "input": this call's K/V; "slab": the whole cache layer; "blocks": padded blocks
    pad: int = 0  # "blocks": rows per sequence's key block
    view_from: int | None = None  # "blocks": first slot when the blocks are a view of the cache, else gathered


#: the dtypes xformers' FlashAttention operators (fa2F, fa3F, the Blackwell CUTLASS kernel) serve on sm80+;
#: only they take a gappy-keys bias
GAPPY_DTYPES = frozenset({torch.float16, torch.bfloat16})


def _gappy_served(cache: KVCache) -> bool:
    spec = cache.spec
    if cache.layout != "flash_contiguous" or spec.dtype not in GAPPY_DTYPES:
        return False
    return spec.device.type != "cuda" or torch.cuda.get_device_capability(spec.device) >= (8, 0)


def _xformers_kernels() -> SimpleNamespace:
    import xformers.ops  # optional, CUDA-only: imported on first use
    from xformers.ops.fmha import attn_bias

    return SimpleNamespace(
        memory_efficient_attention=xformers.ops.memory_efficient_attention,
        BlockDiagonalCausalMask=attn_bias.BlockDiagonalCausalMask,
        BlockDiagonalCausalWithOffsetPaddedKeysMask=attn_bias.BlockDiagonalCausalWithOffsetPaddedKeysMask,
        BlockDiagonalCausalWithOffsetGappyKeysMask=attn_bias.BlockDiagonalCausalWithOffsetGappyKeysMask,
    )


def _import_reason() -> str | None:
    try:
        _xformers_kernels()
    except Exception as exc:
        return f"package 'xformers' is installed but failed to import: {type(exc).__name__}: {exc}".splitlines()[0]
    return None


class XFormersBackend(KernelBackend):
    name = "xformers"
    description = "xformers memory_efficient_attention, one block-diagonal call per layer (5-D GQA)"
    priority = 15
    capabilities = BackendCapabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        kv_layouts=("flash_contiguous", "contiguous"),
        head_dim_multiple=8,
        supports_gqa=True,
        min_compute_capability=XFORMERS_MIN_CC,
        dtype_compute_capability=XFORMERS_DTYPE_CC,
        # no attention variants: memory_efficient_attention has no soft-cap or sink argument, and its local
        # (windowed) biases are not wired here; such layers are refused with the reason
    )

    # memory_efficient_attention, BlockDiagonalCausalMask, BlockDiagonalCausalWithOffset{Padded,Gappy}KeysMask
    _load_kernels = staticmethod(_xformers_kernels)

    @classmethod
    def availability(cls) -> str | None:
        return cuda_availability("xformers", XFORMERS_INSTALL, XFORMERS_MIN_CC) or _import_reason()

    def plan(self, meta: AttentionMetadata, cache: KVCache) -> XFormersPlan:
        """The step's bias object and key geometry, once for every layer (a bias holds device tensors)."""
        xf, slots, device = self.kernels, slot_plan(meta), cache.spec.device
        if max(meta.context_lens) == 0:
            return XFormersPlan(slots, xf.BlockDiagonalCausalMask.from_seqlens(meta.query_lens, device=device))
        slot_len = cache.spec.max_seq_len
        if _gappy_served(cache):  # every sequence's keys where they lie in the cache layer
            starts = [slot * slot_len for slot in meta.slots] + [cache.num_blocks * slot_len]
            bias = xf.BlockDiagonalCausalWithOffsetGappyKeysMask.from_seqlens(
                q_seqlen=meta.query_lens, kv_seqstarts=starts, kv_seqlen=meta.seq_lens, device=device
            )
            return XFormersPlan(slots, bias, keys="slab")
        first, num_seqs = meta.slots[0], meta.num_seqs
        if cache.layout == "flash_contiguous" and meta.slots == list(range(first, first + num_seqs)):
            pad, view_from = slot_len, first  # consecutive slots: the key blocks are the cache itself
        else:
            pad, view_from = meta.max_seq_len, None  # the used rows are gathered into blocks of pad rows
        bias = xf.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
            q_seqlen=meta.query_lens, kv_padding=pad, kv_seqlen=meta.seq_lens, device=device
        )
        return XFormersPlan(slots, bias, keys="blocks", pad=pad, view_from=view_from)

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, H_kv, D]
        v: torch.Tensor,  # [T, H_kv, D]
        cache: KVCache,
        plan: XFormersPlan,
    ) -> torch.Tensor:
        cache.write(layer_idx, k, v, plan.slots.meta)
        if plan.keys == "slab":
            k_cache, v_cache = kv_views(cache, layer_idx)  # [slots, S, H_kv, D], contiguous
            keys, values = k_cache.flatten(0, 1).unsqueeze(0), v_cache.flatten(0, 1).unsqueeze(0)  # views
        elif plan.keys == "blocks":
            keys, values = self._padded_keys(cache, layer_idx, plan)  # [1, B * pad, H_kv, D]
        else:
            keys, values = k.unsqueeze(0), v.unsqueeze(0)  # [1, T, H_kv, D]
        query, keys, values = _grouped(q.unsqueeze(0), keys, values)
        scale = plan.slots.meta.layer(layer_idx).scale
        out = self.kernels.memory_efficient_attention(query, keys, values, attn_bias=plan.bias, p=0.0, scale=scale)
        return out.reshape(q.shape)

    @staticmethod
    def _padded_keys(cache: KVCache, layer_idx: int, plan: XFormersPlan):
        """Each sequence's keys in its own block of ``plan.pad`` rows, as ``[1, B * pad, H_kv, D]``."""
        k_cache, v_cache = kv_views(cache, layer_idx)  # [slots, S, H_kv, D]
        num_seqs, pad = plan.slots.meta.num_seqs, plan.pad
        if plan.view_from is not None:  # a view of the flash_contiguous slab (zero copy)
            rows = slice(plan.view_from, plan.view_from + num_seqs)
            return (k_cache[rows].reshape(1, num_seqs * pad, *k_cache.shape[2:]),
                    v_cache[rows].reshape(1, num_seqs * pad, *v_cache.shape[2:]))
        slots_t = plan.slots.slots_t
        keys = k_cache[slots_t, :pad].reshape(1, num_seqs * pad, *k_cache.shape[2:])  # gathers B × pad rows
        values = v_cache[slots_t, :pad].reshape(1, num_seqs * pad, *v_cache.shape[2:])
        return keys, values


def _grouped(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
    """BMHK, or BMGHK with K/V expanded (stride 0) over the query heads of each KV group."""
    num_heads, num_kv_heads = query.shape[2], keys.shape[2]
    if num_heads == num_kv_heads:
        return query, keys, values
    group = num_heads // num_kv_heads
    b, mq, _, d = query.shape
    mk = keys.shape[1]
    query = query.reshape(b, mq, num_kv_heads, group, d)  # head h = g * group + j
    keys = keys.unsqueeze(3).expand(b, mk, num_kv_heads, group, d)
    values = values.unsqueeze(3).expand(b, mk, num_kv_heads, group, d)
    return query, keys, values


@hookimpl
def kvcore_register_backends(register):
    register(XFormersBackend)
