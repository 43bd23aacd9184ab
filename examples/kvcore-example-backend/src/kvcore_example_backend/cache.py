"""``example_fp16``: a paged KV cache that stores K and V as float16, whatever the model dtype.

It is the built-in ``paged`` cache with a smaller element: pools ``[L, num_blocks, block_size, H_kv, D]``
in float16, written through ``slot_mapping`` and converted back to the model dtype in
:meth:`Float16KVCache.gather_blocks`. For a float32 model that halves the KV bytes per token (a fixed
``kv_cache_bytes`` budget holds twice the tokens) at the price of float16 rounding: a relative error of
at most 2⁻¹¹ per element, and magnitudes beyond float16's largest finite value (65504) saturate to it
instead of becoming ``inf``. For a bfloat16 model it saves nothing (both are 16 bits); float16 holds
bfloat16 values exactly inside its range (6.1e-5 ≤ |x| ≤ 65504), so it is offered there only for
completeness.

Layout "paged": any backend that reads layout "paged" through ``gather_blocks`` (the built-in ``paged``,
this package's ``example_chunked``) serves it unchanged. Option ``block_size`` (``[kv_caches.example_fp16]``;
default ``EngineConfig.block_size``).
"""

from __future__ import annotations

import torch

from kvcore import AttentionMetadata, CacheCapabilities, CacheSpec
from kvcore.backends.paged import PagedKVCache

__all__ = ["Float16KVCache"]

#: float16's largest finite magnitude; larger K/V values are clamped to it
FP16_MAX = torch.finfo(torch.float16).max


class Float16KVCache(PagedKVCache):
    name = "example_fp16"
    layout = "paged"
    description = "example plugin: paged, K/V stored as float16 (half the KV bytes of a float32 model)"
    capabilities = CacheCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float32, torch.bfloat16}),
        precision="float16 K/V storage: 11 significant bits, |x| above 65504 saturates",
        unit_roundoff=2**-11,  # round to nearest with an 11-bit significand
    )

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.float16

    @classmethod
    def token_bytes(cls, spec: CacheSpec) -> int:
        return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2  # K and V, 2 bytes per element

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        # The base class casts to the pool's dtype; clamp first so an outlier saturates instead of
        # becoming inf (and every later softmax over it nan).
        super().write(layer_idx, k.clamp(-FP16_MAX, FP16_MAX), v.clamp(-FP16_MAX, FP16_MAX), meta)

    def gather_blocks(self, layer_idx: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of blocks ``block_ids`` (``[n]`` int64), each ``[n, block_size, H_kv, D]`` in the model dtype."""
        k, v = super().gather_blocks(layer_idx, block_ids)  # float16 copies
        return k.to(self.spec.dtype), v.to(self.spec.dtype)
