"""``xformers``: ``xformers.ops.memory_efficient_attention`` (CUDA only; fp16/bf16, and fp32 through its
CUTLASS kernel).

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
* **GQA/MQA** uses xformers' 5-D ``[B, M, G, H, K]`` layout: ``G = H_kv`` groups of ``H / H_kv`` query
  heads; K/V are ``[B, M, G, 1, K]`` *expanded* (stride 0, no copy) to ``[B, M, G, H/H_kv, K]``, since
  xformers does not broadcast by itself. Query head ``g * (H / H_kv) + j`` reads KV head ``g``, Llama's
  grouping. Plain MHA uses the 4-D ``[B, M, H, K]`` layout.

Cache kinds: ``flash_contiguous`` (shared with ``flash_attn2``; ``[slots, S, H_kv, D]`` per layer, which
allows the zero-copy path) and ``contiguous`` (read through a transposed view, always gathered).

The kernels are reached through ``self.kernels`` (xformers' ``memory_efficient_attention`` and the two
bias classes), imported on first use; tests pass ``kernels=XFORMERS_KERNELS`` from ``tests/kernel_emulation.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvcore.attention import BackendCapabilities
from kvcore.hookspecs import hookimpl
from kvcore.kv_cache import KVCache

from .flash_attn2 import KernelBackend, SlotPlan, cuda_availability, kv_views

__all__ = ["XFormersBackend"]

XFORMERS_INSTALL = "pip install --no-deps xformers==0.0.35 to keep your torch; see docs/gpu-backends.md"
#: xformers' docs: "NVIDIA GPUs with compute capability above 6.0 (P100+)"; bf16 needs sm80
XFORMERS_MIN_CC = (6, 0)


def _xformers_kernels() -> SimpleNamespace:
    import xformers.ops  # optional, CUDA-only: imported on first use
    from xformers.ops.fmha import attn_bias

    return SimpleNamespace(
        memory_efficient_attention=xformers.ops.memory_efficient_attention,
        BlockDiagonalCausalMask=attn_bias.BlockDiagonalCausalMask,
        BlockDiagonalCausalWithOffsetPaddedKeysMask=attn_bias.BlockDiagonalCausalWithOffsetPaddedKeysMask,
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
        # no attention variants: memory_efficient_attention has no soft-cap or sink argument, and its local
        # (windowed) biases are not wired here; such layers are refused with the reason
    )

    # memory_efficient_attention, BlockDiagonalCausalMask, BlockDiagonalCausalWithOffsetPaddedKeysMask
    _load_kernels = staticmethod(_xformers_kernels)

    @classmethod
    def availability(cls) -> str | None:
        return cuda_availability("xformers", XFORMERS_INSTALL, XFORMERS_MIN_CC) or _import_reason()

    def validate(
        self, *, device: torch.device, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int
    ) -> list[str]:
        reasons = super().validate(
            device=device, dtype=dtype, head_dim=head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads
        )
        if dtype == torch.bfloat16 and device.type == "cuda":
            try:
                cc = torch.cuda.get_device_capability(device) if torch.cuda.is_available() else None
            except Exception:
                cc = None
            if cc is not None and cc < (8, 0):
                reasons.append(f"bfloat16 needs compute capability 8.0+ (GPU has {cc[0]}.{cc[1]})")
        return reasons

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, H_kv, D]
        v: torch.Tensor,  # [T, H_kv, D]
        cache: KVCache,
        plan: SlotPlan,
    ) -> torch.Tensor:
        xf = self.kernels
        meta = plan.meta
        cache.write(layer_idx, k, v, meta)
        if max(meta.context_lens) == 0:
            keys, values = k.unsqueeze(0), v.unsqueeze(0)  # [1, T, H_kv, D]
            bias = xf.BlockDiagonalCausalMask.from_seqlens(meta.query_lens, device=q.device)
        else:
            keys, values, pad = self._padded_keys(cache, layer_idx, plan)  # [1, B * pad, H_kv, D]
            bias = xf.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
                q_seqlen=meta.query_lens, kv_padding=pad, kv_seqlen=meta.seq_lens, device=q.device
            )
        query, keys, values = _grouped(q.unsqueeze(0), keys, values)
        scale = meta.layer(layer_idx).scale
        out = xf.memory_efficient_attention(query, keys, values, attn_bias=bias, p=0.0, scale=scale)
        return out.reshape(q.shape)

    @staticmethod
    def _padded_keys(cache: KVCache, layer_idx: int, plan: SlotPlan):
        """Each sequence's keys in its own block of ``pad`` rows, as ``[1, B * pad, H_kv, D]``."""
        k_cache, v_cache = kv_views(cache, layer_idx)  # [slots, S, H_kv, D]
        meta = plan.meta
        slots = meta.slots
        num_seqs, max_len = len(slots), k_cache.shape[1]
        first = slots[0]
        if cache.layout == "flash_contiguous" and slots == list(range(first, first + num_seqs)):
            # consecutive slots of a contiguous slab: the blocks are the cache itself (zero copy)
            keys = k_cache[first : first + num_seqs].reshape(1, num_seqs * max_len, *k_cache.shape[2:])
            values = v_cache[first : first + num_seqs].reshape(1, num_seqs * max_len, *v_cache.shape[2:])
            return keys, values, max_len
        pad = meta.max_seq_len
        slots_t = plan.slots_t
        keys = k_cache[slots_t, :pad].reshape(1, num_seqs * pad, *k_cache.shape[2:])  # gathers B × pad rows
        values = v_cache[slots_t, :pad].reshape(1, num_seqs * pad, *v_cache.shape[2:])
        return keys, values, pad


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
