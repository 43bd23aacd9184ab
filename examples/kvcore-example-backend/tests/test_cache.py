"""``example_fp16``: what goes in comes back rounded to float16, and the bytes it reports are the bytes it holds."""

from __future__ import annotations

import pytest
import torch
from kvcore_example_backend import Float16KVCache

from kvcore import CacheSpec, EngineConfig
from kvcore.backends.paged import PagedKVCache
from kvcore.engine.core import Engine
from kvcore.errors import BackendUnavailableError, ConfigError
from kvcore.plugins.registry import KV_CACHE
from kvcore.scheduling.kv_manager import KVCacheManager


def make_spec(*, dtype=torch.float32, block_size=4, num_blocks=None) -> CacheSpec:
    return CacheSpec(
        num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype, device=torch.device("cpu"),
        max_num_seqs=2, max_seq_len=32, block_size=block_size, num_blocks=num_blocks,
    )


def write_tokens(kv: KVCacheManager, seq_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Append ``k``, ``v`` (``[L, n, H_kv, D]``) to ``seq_id`` in one call, every layer."""
    meta = kv.prepare([seq_id], [k.shape[1]], 1.0)
    for layer in range(k.shape[0]):
        kv.cache.write(layer, k[layer], v[layer], meta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_float16_rounding(dtype):
    spec = make_spec(dtype=dtype)
    kv = KVCacheManager(Float16KVCache(spec))
    gen = torch.Generator().manual_seed(0)
    shape = (spec.num_layers, 11, spec.num_kv_heads, spec.head_dim)  # 11 tokens: across 3 blocks of 4
    k = (torch.randn(shape, generator=gen) * 3).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    kv.add_sequence(0)
    write_tokens(kv, 0, k[:, :7], v[:, :7])  # a prefill, then a continuation
    write_tokens(kv, 0, k[:, 7:], v[:, 7:])
    assert kv.cache.k_pool.dtype == torch.float16
    for layer in range(spec.num_layers):
        k_read, v_read = kv.read(layer, 0)  # [11, H_kv, D] in the model dtype
        assert k_read.dtype == dtype
        assert torch.equal(k_read, k[layer].half().to(dtype))
        assert torch.equal(v_read, v[layer].half().to(dtype))
        if dtype == torch.float32:  # lossy, within float16's unit roundoff
            torch.testing.assert_close(k_read, k[layer], rtol=2**-11, atol=0)
            assert not torch.equal(k_read, k[layer])
        else:  # bfloat16 values inside float16's range are kept exactly
            assert torch.equal(k_read, k[layer])


def test_gather_blocks_returns_model_dtype_blocks():
    spec = make_spec()
    kv = KVCacheManager(Float16KVCache(spec))
    kv.add_sequence(0)
    k = torch.randn(spec.num_layers, 6, spec.num_kv_heads, spec.head_dim)
    write_tokens(kv, 0, k, -k)
    ids = torch.tensor(kv.blocks.block_table(0))
    k_blocks, v_blocks = kv.cache.gather_blocks(1, ids)
    assert k_blocks.shape == (2, spec.block_size, spec.num_kv_heads, spec.head_dim)
    assert k_blocks.dtype == torch.float32
    assert torch.equal(k_blocks.reshape(-1, 2, 8)[:6], k[1].half().float())
    assert torch.equal(v_blocks.reshape(-1, 2, 8)[:6], -k[1].half().float())


def test_out_of_range_values_saturate_instead_of_becoming_inf():
    spec = make_spec()
    kv = KVCacheManager(Float16KVCache(spec))
    kv.add_sequence(0)
    k = torch.full((spec.num_layers, 1, spec.num_kv_heads, spec.head_dim), 1e6)
    write_tokens(kv, 0, k, -k)
    k_read, v_read = kv.read(0, 0)
    assert torch.all(k_read == 65504.0) and torch.all(v_read == -65504.0)


def test_fork_copies_on_write():
    spec = make_spec()
    kv = KVCacheManager(Float16KVCache(spec))
    kv.add_sequence(0)
    k = torch.randn(spec.num_layers, 6, spec.num_kv_heads, spec.head_dim)
    write_tokens(kv, 0, k, k)
    kv.fork_sequence(0, 1)  # shares both blocks; the half-full second one is copied on the next write
    write_tokens(kv, 1, k[:, :1] + 100, k[:, :1] + 100)
    assert torch.equal(kv.read(2, 0)[0], k[2].half().float())
    assert torch.equal(kv.read(2, 1)[0][:6], k[2].half().float())
    assert torch.equal(kv.read(2, 1)[0][6], (k[2, 0] + 100).half().float())


def test_bytes_are_half_of_a_float32_paged_cache():
    spec = make_spec(num_blocks=10)
    cache, full = Float16KVCache(spec), PagedKVCache(spec)
    expected = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2  # K and V, 2 bytes each
    assert Float16KVCache.token_bytes(spec) == cache.bytes_per_token == expected == full.bytes_per_token // 2
    held = sum(t.numel() * t.element_size() for t in (cache.k_pool, cache.v_pool))
    assert cache.kv_bytes_allocated == held == 10 * spec.block_size * expected
    assert cache.kv_bytes_allocated == full.kv_bytes_allocated // 2


def test_a_kv_memory_budget_holds_twice_the_float32_tokens(registry, make_model):
    model = make_model()
    budget = 64 * 1024
    engines = {
        name: Engine(model, None, EngineConfig(backend="example_chunked", kv_cache=name, kv_cache_bytes=budget),
                     registry=registry)
        for name in ("paged", "example_fp16")
    }
    assert engines["example_fp16"].cache.num_blocks == 2 * engines["paged"].cache.num_blocks
    assert engines["example_fp16"].cache.kv_bytes_allocated <= budget


def test_declared_lossy_and_registered(registry):
    caps = Float16KVCache.capabilities
    assert caps.precision and caps.unit_roundoff == 2**-11
    entry = registry.get("example_fp16", KV_CACHE)
    assert entry.cls is Float16KVCache and entry.cls.layout == "paged" and entry.plugin == "example_chunked"


def test_block_size_option_and_unknown_options(registry):
    cache = registry.create_cache("example_fp16", make_spec(), {"block_size": 8})
    assert cache.block_size == 8
    with pytest.raises(ConfigError, match="bits"):
        registry.create_cache("example_fp16", make_spec(), {"bits": 8})


def test_float16_models_are_refused_with_the_reason(registry):
    with pytest.raises(BackendUnavailableError, match="dtype float16 not supported"):
        registry.create_cache("example_fp16", make_spec(dtype=torch.float16))
