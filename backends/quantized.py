"""``int8``: a paged KV cache storing K and V as int8 with one scale per token and KV head.

Each written row ``x`` (``[D]``, one token of one KV head) is stored as ``round(x / s)`` in int8 with
``s = max|x| / 127`` kept in float32, and read back as ``q · s`` in the model dtype. The rounding
error of an element is at most ``s / 2 = max|x| / 254``. Bytes per token and layer drop from
``2 · H_kv · D · bytes(dtype)`` to ``2 · H_kv · (D + 4)``: about a quarter of float32 and a half of
bfloat16 at head_dim 64, so a fixed KV memory budget holds about 4× (float32) or 2× (bfloat16) the tokens.

Layout "paged": it is read through :meth:`~PagedKVCache.gather_blocks` like the ``paged`` cache, so the
``paged`` backend (and any backend reading layout "paged") serves it unchanged, dequantized in attention.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore.hookspecs import hookimpl
from kvcore.interfaces.kv_cache import CacheCapabilities, CacheSpec, zeros
from kvcore.interfaces.metadata import AttentionMetadata

from .contiguous import ALL_DTYPES
from .paged import PagedKVCache

__all__ = ["Int8KVCache"]

#: the largest int8 magnitude used, symmetric so that 0 stays exact
QMAX = 127


class Int8KVCache(PagedKVCache):
    name = "int8"
    layout = "paged"
    description = "paged, K/V in int8 with a float32 scale per token and KV head (~1/4 of fp32 KV bytes)"
    capabilities = CacheCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=ALL_DTYPES,
        precision="int8 K/V, symmetric, one float32 scale per token and KV head (max|x| / 127)",
        unit_roundoff=1 / (2 * QMAX),
        no_window_pool=None,
    )

    def __init__(self, spec: CacheSpec, block_size: int | None = None, **options: Any) -> None:
        super().__init__(spec, block_size, **options)
        shape = self.k_pool.shape[:-1]  # [L, num_blocks, block_size, H_kv]
        self.k_scale = zeros(shape, dtype=torch.float32, device=self.spec.device)
        self.v_scale = zeros(shape, dtype=torch.float32, device=self.spec.device)

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.int8

    @classmethod
    def token_bytes(cls, spec: CacheSpec) -> int:
        return 2 * spec.num_storage_layers * spec.num_kv_heads * (spec.head_dim + 4)  # int8 values + a float32 scale

    @staticmethod
    def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[..., D]`` → int8 values ``[..., D]`` and float32 scales ``[...]``."""
        x = x.float()
        scale = x.abs().amax(dim=-1) / QMAX
        q = torch.round(x / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).clamp_(-QMAX, QMAX)
        return q.to(torch.int8), scale

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        h_kv, d, row = self.spec.num_kv_heads, self.spec.head_dim, self.rows[layer_idx]
        for pool, scales, x in ((self.k_pool, self.k_scale, k), (self.v_pool, self.v_scale, v)):
            q, s = self.quantize(x)  # [T, H_kv, D], [T, H_kv]
            pool[row].view(-1, h_kv, d).index_copy_(0, meta.slot_mapping, q)
            scales[row].view(-1, h_kv).index_copy_(0, meta.slot_mapping, s)

    def gather_blocks(self, layer_idx: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = super().gather_blocks(layer_idx, block_ids)  # int8 [n, block_size, H_kv, D]
        k_scale = self.k_scale[self.rows[layer_idx]].index_select(0, block_ids)  # [n, block_size, H_kv]
        v_scale = self.v_scale[self.rows[layer_idx]].index_select(0, block_ids)
        dtype = self.spec.dtype
        return (k.float() * k_scale[..., None]).to(dtype), (v.float() * v_scale[..., None]).to(dtype)

    def storage(self) -> tuple[torch.Tensor, ...]:
        return self.k_pool, self.v_pool, self.k_scale, self.v_scale  # scales copy with their blocks


@hookimpl
def kvcore_register_kv_caches(register):
    register(Int8KVCache)
