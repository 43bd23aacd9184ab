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

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from kvcore.attention import AttentionBackend, AttentionMetadata, BackendCapabilities
from kvcore.errors import BackendError, ConfigError
from kvcore.hookspecs import hookimpl
from kvcore.kv_cache import CacheSpec, ContiguousKVCache, KVCache, SlotKVCache, register_cache_kind

__all__ = ["FlashAttn2Backend", "FlashKVCache", "KernelBackend", "cuda_availability", "kv_views"]

FLASH_ATTN_INSTALL = "pip install flash-attn --no-build-isolation; see docs/gpu-backends.md"
#: flash-attn 2.8.3's csrc/flash_attn/flash_api.cpp: ``TORCH_CHECK(cc_major >= 8, "FlashAttention only
#: supports Ampere GPUs or newer.")`` (older 2.x releases accepted only sm8x and sm90)
FLASH_MIN_CC = (8, 0)
FLASH_MIN_VERSION = (2, 6)  # flash_attn_with_kvcache with cache_batch_idx / cache_leftpad keywords


# -- availability (shared with the xformers backend) ---------------------------------------------------
def cuda_availability(module: str, install_hint: str, min_cc: tuple[int, int]) -> str | None:
    """The first reason ``module``'s CUDA kernels cannot run here, or None. Never raises.

    Order: package missing (cheap ``find_spec``, no import) → no CUDA device → compute capability.
    """
    try:
        if importlib.util.find_spec(module) is None:
            return f"package '{module}' is not installed ({install_hint})"
        if not torch.cuda.is_available():
            return "no CUDA device (torch.cuda.is_available() is False)"
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < min_cc:
            need = f"sm{min_cc[0]}{min_cc[1]}+ required"
            return f"GPU compute capability {major}.{minor} < {min_cc[0]}.{min_cc[1]} ({need})"
    except Exception as exc:  # availability() must never raise
        return f"availability check failed: {type(exc).__name__}: {exc}".splitlines()[0]
    return None


def _import_reason(module: str) -> str | None:
    """Import ``module`` (only once CUDA is known to be there); a one-line reason if that fails."""
    try:
        importlib.import_module(module)
    except Exception as exc:
        return f"package '{module}' is installed but failed to import: {type(exc).__name__}: {exc}".splitlines()[0]
    return None


# -- the flash-layout KV cache ---------------------------------------------------------------------------
@register_cache_kind
class FlashKVCache(SlotKVCache):
    """Contiguous per-slot cache in flash-attn's layout: ``k[layer]`` is ``[max_num_seqs, max_seq_len,
    H_kv, D]`` (``[batch, seqlen, nheads_k, headdim]``, what ``flash_attn_with_kvcache`` takes as
    ``k_cache``). A sequence owns one slot for its life; token ``p`` lives at ``k[layer, slot, p]``.
    """

    kind = "flash_contiguous"

    @staticmethod
    def _storage_shape(spec: CacheSpec) -> tuple[int, ...]:
        return (spec.num_layers, spec.max_num_seqs, spec.max_seq_len, spec.num_kv_heads, spec.head_dim)

    def _copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        self.k[:, dst_slot, :length] = self.k[:, src_slot, :length]
        self.v[:, dst_slot, :length] = self.v[:, src_slot, :length]

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        cm = meta.cache_meta
        self.k[layer_idx, cm.token_slots, meta.positions] = k  # [T, H_kv, D]
        self.v[layer_idx, cm.token_slots, meta.positions] = v

    def read(self, layer_idx: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        slot, length = self.slot_of[seq_id], self.seq_len(seq_id)
        return self.k[layer_idx, slot, :length].clone(), self.v[layer_idx, slot, :length].clone()


# -- glue shared with the xformers backend -----------------------------------------------------------------
def kv_views(cache: KVCache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of the cache as ``[num_slots, max_seq_len, H_kv, D]`` views (no copy)."""
    if isinstance(cache, FlashKVCache):
        return cache.k[layer_idx], cache.v[layer_idx]
    if isinstance(cache, ContiguousKVCache) and cache.kind == "contiguous":
        # [slots, H_kv, S, D] -> [slots, S, H_kv, D]: strided view, last dim still contiguous
        return cache.k[layer_idx].transpose(1, 2), cache.v[layer_idx].transpose(1, 2)
    raise BackendError(f"cannot read a '{cache.kind}' KV cache (reads: flash_contiguous, contiguous)")


def cu_seqlens(lengths: list[int], device: torch.device) -> torch.Tensor:
    """int32 prefix sums ``[0, l0, l0 + l1, ...]`` (flash-attn's ``cu_seqlens``)."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def slots_i32(meta: AttentionMetadata) -> torch.Tensor:
    """Cache slot of each batch row as int32 (flash-attn's ``cache_batch_idx``)."""
    return meta.cache_meta.slots_i32


@dataclass
class GatherPlan:
    """Where every sequence's full key range lives in a ``[slots, S, H_kv, D]`` view."""

    slot_idx: torch.Tensor  # [sum(seq_lens)] int64
    pos_idx: torch.Tensor  # [sum(seq_lens)] int64
    cu_seqlens_k: torch.Tensor  # [B + 1] int32


def gather_plan(meta: AttentionMetadata, device: torch.device) -> GatherPlan:
    """Built once per call (cached in ``meta.extras``) and reused by every layer."""
    plan = meta.extras.get("kvcore.gather_plan")
    if plan is None:
        seq_lens = meta.seq_lens
        cu_k = cu_seqlens(seq_lens, device)
        lens = torch.tensor(seq_lens, dtype=torch.long, device=device)
        starts = cu_k[:-1].long().repeat_interleave(lens)  # first packed row of each row's sequence
        plan = GatherPlan(
            slot_idx=meta.cache_meta.slots_t.to(device).repeat_interleave(lens),
            pos_idx=torch.arange(int(cu_k[-1]), device=device) - starts,
            cu_seqlens_k=cu_k,
        )
        meta.extras["kvcore.gather_plan"] = plan
    return plan


# -- the backend ---------------------------------------------------------------------------------------
def _flash_attn_module() -> Any:
    import flash_attn  # optional, CUDA-only: imported on first use

    return flash_attn


class KernelBackend(AttentionBackend):
    """A backend that calls its kernels through ``self.kernels``: the real package by default
    (imported on first use), or an object passed as ``kernels=`` (tests pass the CPU emulations)."""

    @staticmethod
    def _load_kernels() -> Any:
        raise NotImplementedError

    def __init__(self, kernels: Any = None, **options: Any) -> None:
        super().__init__(**options)
        if isinstance(kernels, str):
            raise ConfigError(f"backend '{self.name}': 'kernels' is a testing hook and cannot be set from a config")
        self._kernels = kernels

    @property
    def kernels(self) -> Any:
        if self._kernels is None:
            self._kernels = self._load_kernels()
        return self._kernels


class FlashAttn2Backend(KernelBackend):
    name = "flash_attn2"
    description = "flash-attn 2: varlen prefill, flash_attn_with_kvcache decode (in-place append)"
    priority = 20
    capabilities = BackendCapabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        cache_kinds=("flash_contiguous", "contiguous"),
        max_head_dim=256,
        head_dim_multiple=8,
        supports_gqa=True,
        min_compute_capability=FLASH_MIN_CC,
    )

    _load_kernels = staticmethod(_flash_attn_module)  # flash_attn_varlen_func, flash_attn_with_kvcache

    @classmethod
    def availability(cls) -> str | None:
        reason = cuda_availability("flash_attn", FLASH_ATTN_INSTALL, FLASH_MIN_CC)
        if reason is None:
            reason = _import_reason("flash_attn") or _version_reason()
        return reason

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, H_kv, D]
        v: torch.Tensor,  # [T, H_kv, D]
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_views(cache, layer_idx)  # [slots, S, H_kv, D]
        if meta.is_decode:
            return self._decode(q, k, v, k_cache, v_cache, meta)
        return self._prefill(layer_idx, q, k, v, cache, k_cache, v_cache, meta)

    def _decode(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        cache_seqlens = meta.extras.get("kvcore.context_lens_i32")
        if cache_seqlens is None:  # lengths BEFORE this step's append
            cache_seqlens = meta.extras["kvcore.context_lens_i32"] = torch.tensor(
                meta.context_lens, dtype=torch.int32, device=q.device
            )
        out = self.kernels.flash_attn_with_kvcache(
            q.unsqueeze(1),  # [B, 1, H, D]
            k_cache,
            v_cache,
            k=k.unsqueeze(1),  # [B, 1, H_kv, D], appended in place at cache_seqlens
            v=v.unsqueeze(1),
            cache_seqlens=cache_seqlens,
            cache_batch_idx=slots_i32(meta),
            softmax_scale=meta.scale,
            causal=True,  # one query row: the kernel treats it as non-causal, it sees every key
        )
        return out.squeeze(1)

    def _prefill(self, layer_idx, q, k, v, cache: KVCache, k_cache, v_cache, meta: AttentionMetadata):
        cache.write(layer_idx, k, v, meta)
        if max(meta.context_lens) == 0:  # every sequence starts fresh: this call's K/V are all the keys
            keys, values = k, v
            cu_k, max_k = meta.cu_seqlens_q, meta.max_query_len
        else:
            plan = gather_plan(meta, q.device)
            keys = k_cache[plan.slot_idx, plan.pos_idx]  # [sum(seq_lens), H_kv, D]
            values = v_cache[plan.slot_idx, plan.pos_idx]
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
            softmax_scale=meta.scale,
            causal=True,  # bottom-right aligned: query i of a sequence is at position context_len + i
        )


def _version_reason() -> str | None:
    try:
        import flash_attn

        parts = tuple(int(p) for p in str(flash_attn.__version__).split(".")[:2])
    except Exception:
        return None  # no parsable version: let the kernels speak for themselves
    if parts[0] != 2 or parts < FLASH_MIN_VERSION:
        want = ".".join(map(str, FLASH_MIN_VERSION))
        return f"flash_attn {flash_attn.__version__} found; this backend needs flash-attn 2.x >= {want}"
    return None


@hookimpl
def kvcore_register_backends(register):
    register(FlashAttn2Backend)
