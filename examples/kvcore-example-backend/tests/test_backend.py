"""``example_chunked`` against kvcore's ``naive`` reference, on every layout it declares.

Each test drives both backends through the same calls (ragged prefills, decode steps, a prefill that
continues a cache) with the same random q/k/v, through kvcore's own block manager
(:class:`~kvcore.scheduling.kv_manager.KVCacheManager`), and compares every layer's output.
"""

from __future__ import annotations

import random

import pytest
import torch
from kvcore_example_backend import ChunkedAttentionBackend, Float16KVCache

from kvcore import AttentionBackend, CacheSpec, KVCache
from kvcore.backends.contiguous import ContiguousKVCache
from kvcore.backends.naive import NaiveBackend
from kvcore.backends.paged import PagedBackend, PagedKVCache
from kvcore.backends.quantized import Int8KVCache
from kvcore.errors import ConfigError
from kvcore.scheduling.kv_manager import KVCacheManager

#: (seq_ids, query_lens) of one call each: ragged prefill (one prompt of 1 token), decodes, a prefill
#: continuing every cache, a decode of a subset
CALLS = [
    ([0, 1, 2], [5, 19, 1]),
    ([0, 1, 2], [1, 1, 1]),
    ([0, 1, 2], [1, 1, 1]),
    ([0, 1, 2], [12, 3, 30]),
    ([2, 0], [1, 1]),
]


def make_spec(num_kv_heads: int, head_dim: int, *, block_size: int = 4, dtype=torch.float32) -> CacheSpec:
    return CacheSpec(
        num_layers=2, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=torch.device("cpu"),
        max_num_seqs=3, max_seq_len=64, block_size=block_size,
    )


def shuffled(kv: KVCacheManager, seed: int = 0) -> KVCacheManager:
    """Take every block and give them back in random order, so block tables are not contiguous."""
    alloc = kv.blocks.allocator
    blocks = [alloc.allocate() for _ in range(alloc.num_blocks)]
    random.Random(seed).shuffle(blocks)
    for b in blocks:
        alloc.free(b)
    return kv


def run_pair(
    backend: AttentionBackend, kv: KVCacheManager, ref: AttentionBackend, ref_kv: KVCacheManager,
    num_heads: int, *, atol: float, dtype=torch.float32,
) -> None:
    """Run :data:`CALLS` through both; every layer's output must agree within ``atol``."""
    spec = kv.cache.spec
    gen = torch.Generator().manual_seed(0)
    for s in (0, 1, 2):
        kv.add_sequence(s)
        ref_kv.add_sequence(s)
    scale = spec.head_dim**-0.5
    for seq_ids, query_lens in CALLS:
        meta, ref_meta = kv.prepare(seq_ids, query_lens, scale), ref_kv.prepare(seq_ids, query_lens, scale)
        plan, ref_plan = backend.plan(meta, kv.cache), ref.plan(ref_meta, ref_kv.cache)
        total = sum(query_lens)
        for layer in range(spec.num_layers):
            q = torch.randn(total, num_heads, spec.head_dim, generator=gen).to(dtype)
            k = torch.randn(total, spec.num_kv_heads, spec.head_dim, generator=gen).to(dtype)
            v = torch.randn(total, spec.num_kv_heads, spec.head_dim, generator=gen).to(dtype)
            out = backend.forward(layer, q, k, v, kv.cache, plan)
            expected = ref.forward(layer, q, k, v, ref_kv.cache, ref_plan)
            assert out.shape == q.shape and out.dtype == q.dtype
            torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0)


def test_declares_both_built_in_layouts():
    assert ChunkedAttentionBackend.capabilities.kv_layouts == ("contiguous", "paged")


@pytest.mark.parametrize("chunk_size", [1, 8, 64])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("cache_cls", [ContiguousKVCache, PagedKVCache], ids=["contiguous", "paged"])
def test_matches_naive(cache_cls, num_heads, num_kv_heads, chunk_size):
    spec = make_spec(num_kv_heads, 16)
    kv = KVCacheManager(cache_cls(spec))
    if cache_cls.paged:
        shuffled(kv)
    ref_kv = KVCacheManager(ContiguousKVCache(spec))
    run_pair(ChunkedAttentionBackend(chunk_size=chunk_size), kv, NaiveBackend(), ref_kv, num_heads, atol=1e-5)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("cache_cls", [ContiguousKVCache, PagedKVCache], ids=["contiguous", "paged"])
def test_half_precision_close_to_naive(cache_cls, dtype, atol):
    spec = make_spec(2, 16, dtype=dtype)
    kv = shuffled(KVCacheManager(cache_cls(spec)))
    run_pair(ChunkedAttentionBackend(chunk_size=8), kv, NaiveBackend(), KVCacheManager(ContiguousKVCache(spec)), 4,
             atol=atol, dtype=dtype)


@pytest.mark.parametrize("cache_cls", [Int8KVCache, Float16KVCache], ids=["int8", "example_fp16"])
def test_reads_any_paged_layout_cache_through_gather_blocks(cache_cls: type[KVCache]):
    """A lossy layout-"paged" cache: both backends see the same stored (rounded) K/V, so they agree closely."""
    spec = make_spec(2, 16)
    kv, ref_kv = shuffled(KVCacheManager(cache_cls(spec))), shuffled(KVCacheManager(cache_cls(spec)))
    run_pair(ChunkedAttentionBackend(chunk_size=8), kv, PagedBackend(), ref_kv, 4, atol=1e-5)


def test_example_fp16_close_to_naive_on_full_precision():
    spec = make_spec(2, 16)
    kv = shuffled(KVCacheManager(Float16KVCache(spec)))
    run_pair(ChunkedAttentionBackend(), kv, NaiveBackend(), KVCacheManager(ContiguousKVCache(spec)), 4, atol=2e-3)


def test_refuses_a_layout_it_does_not_read():
    class OtherLayout(ContiguousKVCache):
        name, layout = "other", "other"

    spec = make_spec(2, 16)
    kv = KVCacheManager(OtherLayout(spec))
    kv.add_sequence(0)
    meta = kv.prepare([0], [3], 0.25)
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    with pytest.raises(ConfigError, match="layout 'other'"):
        ChunkedAttentionBackend().forward(0, q, k, k, kv.cache, meta)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_invalid_chunk_size_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="chunk_size"):
        ChunkedAttentionBackend(chunk_size=bad)


def test_unknown_option_is_a_config_error():
    with pytest.raises(ConfigError, match="chunk"):  # the error names the option
        ChunkedAttentionBackend(chunk=8)
