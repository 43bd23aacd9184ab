"""The paged backend and cache against the naive backend (the oracle) on a contiguous cache.

Block bookkeeping lives in the core (:class:`~kvcore.scheduling.block_manager.BlockManager`), storage in the caches;
:class:`~kvcore.scheduling.kv_manager.KVCacheManager` ties one cache to its block tables, so every test here drives a
cache through a manager, as the engine does.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.backends.contiguous import ContiguousKVCache
from kvcore.backends.naive import NaiveBackend
from kvcore.backends.paged import PagedBackend, PagedKVCache
from kvcore.errors import ConfigError, ContextLengthError, KVCoreError, OutOfBlocksError
from kvcore.interfaces.kv_cache import CacheSpec
from kvcore.plugins.registry import KV_CACHE, PluginRegistry, get_registry
from kvcore.scheduling.kv_manager import KVCacheManager

CPU = torch.device("cpu")
FP32_ATOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread is ~2x faster than two on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_spec(num_kv_heads=2, head_dim=32, *, layers=2, max_num_seqs=4, max_seq_len=160, block_size=16,
              num_blocks=None, dtype=torch.float32) -> CacheSpec:
    return CacheSpec(
        num_layers=layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=CPU,
        max_num_seqs=max_num_seqs, max_seq_len=max_seq_len, block_size=block_size, num_blocks=num_blocks,
    )


def paged_manager(**spec_kw) -> KVCacheManager:
    return KVCacheManager(PagedKVCache(make_spec(**spec_kw)))


def shuffle_pool(kv: KVCacheManager, seed: int = 0) -> None:
    """Take every block and give them back in random order, so later tables are non-contiguous."""
    alloc = kv.blocks.allocator
    blocks = [alloc.allocate() for _ in range(alloc.num_blocks)]
    random.Random(seed).shuffle(blocks)
    for b in blocks:
        alloc.free(b)


class Pair:
    """The paged backend on a paged cache next to the naive backend on a contiguous cache."""

    def __init__(self, num_heads, num_kv_heads, head_dim, *, block_size=16, dtype=torch.float32, shuffle=True,
                 **spec_kw):
        self.num_heads, self.num_kv_heads, self.head_dim, self.dtype = num_heads, num_kv_heads, head_dim, dtype
        spec = make_spec(num_kv_heads, head_dim, block_size=block_size, dtype=dtype, **spec_kw)
        self.paged_backend = PagedBackend()
        self.naive_backend = NaiveBackend()
        self.paged = KVCacheManager(PagedKVCache(spec))
        self.contig = KVCacheManager(ContiguousKVCache(spec))
        if shuffle:
            shuffle_pool(self.paged)
        self.gen = torch.Generator().manual_seed(1234)

    def add(self, *seq_ids):
        for s in seq_ids:
            self.paged.add_sequence(s)
            self.contig.add_sequence(s)

    def fork(self, src, dst):
        self.paged.fork_sequence(src, dst)
        self.contig.fork_sequence(src, dst)

    def step(self, seq_ids, query_lens, atol=FP32_ATOL):
        scale = self.head_dim**-0.5
        mp = self.paged.prepare(seq_ids, query_lens, scale)
        mc = self.contig.prepare(seq_ids, query_lens, scale)
        plan_p = self.paged_backend.plan(mp, self.paged.cache)  # once per call, shared by the layers
        plan_c = self.naive_backend.plan(mc, self.contig.cache)
        total = sum(query_lens)
        for layer in range(self.paged.cache.spec.num_layers):
            q = torch.randn(total, self.num_heads, self.head_dim, generator=self.gen).to(self.dtype)
            k = torch.randn(total, self.num_kv_heads, self.head_dim, generator=self.gen).to(self.dtype)
            v = torch.randn(total, self.num_kv_heads, self.head_dim, generator=self.gen).to(self.dtype)
            out = self.paged_backend.forward(layer, q, k, v, self.paged.cache, plan_p)
            ref = self.naive_backend.forward(layer, q, k, v, self.contig.cache, plan_c)
            assert out.shape == q.shape and out.dtype == q.dtype
            torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)
        return mp

    def check_contents(self):
        assert sorted(self.paged.blocks.seq_ids) == sorted(self.contig.blocks.seq_ids)
        for s in self.paged.blocks.seq_ids:
            assert self.paged.seq_len(s) == self.contig.seq_len(s)
            for layer in range(self.paged.cache.spec.num_layers):
                kp, vp = self.paged.read(layer, s)
                kc, vc = self.contig.read(layer, s)
                assert torch.equal(kp, kc) and torch.equal(vp, vc)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_matches_naive_prefill_decode_continue(num_heads, num_kv_heads, head_dim):
    bs = 16
    pair = Pair(num_heads, num_kv_heads, head_dim, block_size=bs)
    pair.add(0, 1, 2, 3)
    # ragged prefill hitting every block-boundary case
    pair.step([0, 1, 2, 3], [1, bs - 1, bs, bs + 1])
    for _ in range(3):
        pair.step([0, 1, 2, 3], [1, 1, 1, 1])  # decode
    pair.step([0, 1, 2, 3], [3, bs + 2, 1, 2 * bs])  # prefill continuing the cache, mixed with a 1-token row
    pair.step([2, 0], [1, 1])  # decode of a subset, order swapped
    pair.check_contents()
    tables = [pair.paged.blocks.block_table(s) for s in range(4)]
    assert any(t != sorted(t) or any(b - a != 1 for a, b in zip(t, t[1:])) for t in tables), tables


def test_decode_against_long_caches():
    pair = Pair(8, 2, 64, block_size=16, max_seq_len=400, layers=1)
    pair.add(0, 1, 2)
    pair.step([0, 1, 2], [300, 17, 129])
    for _ in range(2):
        pair.step([0, 1, 2], [1, 1, 1])
    pair.check_contents()


def test_single_token_prompts_use_the_decode_path():
    pair = Pair(4, 2, 32, layers=1)
    pair.add(0, 1)
    meta = pair.step([0, 1], [1, 1])  # context 0, query 1: every key is visible
    assert pair.paged_backend.plan(meta, pair.paged.cache).key_mask is not None  # the batched decode path
    pair.step([0, 1], [1, 1])


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
def test_half_precision_close_to_naive(dtype, atol):
    pair = Pair(8, 2, 64, dtype=dtype, layers=1)
    pair.add(0, 1)
    pair.step([0, 1], [20, 33], atol=atol)
    pair.step([0, 1], [1, 1], atol=atol)
    pair.step([0, 1], [5, 1], atol=atol)


def test_block_size_one_and_large():
    for bs in (1, 64):
        pair = Pair(4, 2, 32, block_size=bs, layers=1)
        pair.add(0, 1)
        pair.step([0, 1], [7, 70])
        pair.step([0, 1], [1, 1])
        pair.check_contents()


# -- cache accounting ------------------------------------------------------------------------------------


def test_reserved_slots_bounded_and_all_blocks_returned():
    bs = 16
    kv = paged_manager(block_size=bs, max_num_seqs=6)
    blocks = kv.blocks
    lens = [1, bs - 1, bs, bs + 1, 3 * bs + 5, 50]
    for s in range(len(lens)):
        kv.add_sequence(s)
    kv.prepare(list(range(len(lens))), lens, 1.0)
    kv.prepare([0, 3, 5], [1, bs, 30], 1.0)  # a mixed batch continuing three of them
    for s in range(len(lens)):
        n = kv.seq_len(s)
        assert len(blocks.block_table(s)) == math.ceil(n / bs)
        assert 0 <= blocks.num_reserved_slots(s) <= bs - 1
    used = sum(len(blocks.block_table(s)) for s in range(len(lens)))
    assert blocks.num_free_blocks == blocks.num_blocks - used
    for s in range(len(lens)):
        kv.free_sequence(s)
    assert blocks.num_free_blocks == blocks.num_blocks
    assert all(blocks.allocator.ref_count(b) == 0 for b in range(blocks.num_blocks))


def test_num_blocks_default_and_explicit():
    spec = make_spec(max_num_seqs=3, max_seq_len=100, block_size=16)
    cache = PagedKVCache(spec)
    assert cache.num_blocks == math.ceil(3 * 100 / 16)
    assert cache.k_pool.shape == (2, cache.num_blocks, 16, 2, 32) == cache.v_pool.shape
    assert cache.kv_bytes_allocated == 2 * cache.k_pool.numel() * 4
    assert PagedKVCache(make_spec(num_blocks=7)).num_blocks == 7
    assert isinstance(get_registry().create_cache("paged", spec), PagedKVCache)
    # the manager's pool is the cache's
    kv = KVCacheManager(cache)
    assert kv.blocks.num_blocks == cache.num_blocks and kv.blocks.block_size == 16
    assert kv.blocks.max_seq_len == 100


def test_metadata_addressing():
    bs = 4
    kv = paged_manager(block_size=bs, num_blocks=20)
    shuffle_pool(kv, seed=3)
    kv.add_sequence(10)
    kv.add_sequence(11)
    kv.prepare([10], [2], 1.0)
    meta = kv.prepare([11, 10], [9, 3], 1.0)  # seq 11: 3 blocks, seq 10: 2 blocks (padded)
    t10, t11 = kv.blocks.block_table(10), kv.blocks.block_table(11)
    assert len(t11) == 3 and len(t10) == 2
    assert meta.block_tables == [t11, t10] and meta.block_size == bs
    assert meta.block_tables_t.dtype == torch.int32 and meta.block_tables_t.shape == (2, 3)
    assert meta.block_tables_t.tolist() == [t11, t10 + [0]]  # padded with block 0, masked by seq_lens
    assert meta.slot_mapping.dtype == torch.int64
    expected = [t11[p // bs] * bs + p % bs for p in range(9)] + [t10[p // bs] * bs + p % bs for p in range(2, 5)]
    assert meta.slot_mapping.tolist() == expected
    assert meta.seq_lens_t.tolist() == [9, 5] and meta.seq_lens == [9, 5]
    assert meta.context_lens == [0, 2] and meta.positions.tolist() == list(range(9)) + [2, 3, 4]
    assert meta.cu_seqlens_q.tolist() == [0, 9, 12]


def test_write_never_touches_other_sequences():
    kv = paged_manager(num_kv_heads=1, head_dim=2, layers=1, block_size=4, num_blocks=12)
    shuffle_pool(kv, seed=5)
    for s in range(3):
        kv.add_sequence(s)
    meta = kv.prepare([0, 1, 2], [5, 2, 7], 1.0)
    vals = torch.arange(14, dtype=torch.float32)[:, None, None].expand(14, 1, 2)
    kv.cache.write(0, vals, -vals, meta)
    assert kv.read(0, 0)[0][:, 0, 0].tolist() == [0, 1, 2, 3, 4]
    assert kv.read(0, 1)[0][:, 0, 0].tolist() == [5, 6]
    assert kv.read(0, 2)[1][:, 0, 0].tolist() == [-7, -8, -9, -10, -11, -12, -13]


# -- fork / copy-on-write --------------------------------------------------------------------------------


def test_fork_shares_blocks_and_copies_on_write():
    bs = 16
    kv = paged_manager(block_size=bs, num_blocks=10, layers=2)
    alloc = kv.blocks.allocator
    kv.add_sequence(0)
    meta = kv.prepare([0], [20], 1.0)
    for layer in range(2):
        kv.cache.write(layer, torch.randn(20, 2, 32), torch.randn(20, 2, 32), meta)
    parent_before = [kv.read(layer, 0) for layer in range(2)]
    free_before = kv.blocks.num_free_blocks

    kv.fork_sequence(0, 1)
    shared = kv.blocks.block_table(0)
    assert kv.blocks.block_table(1) == shared and kv.seq_len(1) == 20
    assert [alloc.ref_count(b) for b in shared] == [2, 2]
    assert kv.blocks.num_free_blocks == free_before  # a fork takes no block

    meta = kv.prepare([1], [1], 1.0)  # the child writes into the shared, partly filled last block
    for layer in range(2):
        kv.cache.write(layer, torch.full((1, 2, 32), 7.0), torch.full((1, 2, 32), 8.0), meta)
    child = kv.blocks.block_table(1)
    assert child[0] == shared[0] and child[1] != shared[1]
    assert meta.block_tables == [child]  # the call addresses the copy, not the shared block
    assert kv.blocks.block_table(0) == shared
    assert alloc.ref_count(shared[0]) == 2  # the full prefix block stays shared
    assert alloc.ref_count(shared[1]) == 1 and alloc.ref_count(child[1]) == 1
    assert kv.blocks.num_free_blocks == free_before - 1
    for layer in range(2):
        kp, vp = kv.read(layer, 0)
        assert torch.equal(kp, parent_before[layer][0]) and torch.equal(vp, parent_before[layer][1])
        kc, vc = kv.read(layer, 1)
        assert torch.equal(kc[:20], kp) and torch.equal(vc[:20], vp)  # the copy carried the prefix
        assert torch.all(kc[20] == 7.0) and torch.all(vc[20] == 8.0)

    # the parent now holds its last block alone: it writes in place, no copy
    kv.prepare([0], [1], 1.0)
    assert kv.blocks.block_table(0) == shared and kv.blocks.num_free_blocks == free_before - 1

    kv.free_sequence(0)
    assert alloc.ref_count(shared[0]) == 1
    kv.free_sequence(1)
    assert kv.blocks.num_free_blocks == kv.blocks.num_blocks


def test_fork_at_block_boundary_needs_no_copy():
    kv = paged_manager(block_size=8, num_blocks=6)
    kv.add_sequence(0)
    kv.prepare([0], [16], 1.0)
    kv.fork_sequence(0, 1)
    table = kv.blocks.block_table(0)
    assert kv.blocks.reserve([1], [1]) == []  # no copy-on-write pair
    assert kv.blocks.block_table(1)[:2] == table and len(kv.blocks.block_table(1)) == 3
    assert [kv.blocks.allocator.ref_count(b) for b in table] == [2, 2]


def test_fork_then_decode_both_matches_naive():
    """Parent and child both write into the shared last block in one call: one copy, not two."""
    pair = Pair(8, 2, 32, block_size=16)
    pair.add(0)
    pair.step([0], [21])
    pair.fork(0, 1)
    free = pair.paged.blocks.num_free_blocks
    assert pair.paged.blocks.num_blocks_needed([0, 1], [1, 1]) == 1
    pair.step([0, 1], [1, 1])
    assert pair.paged.blocks.num_free_blocks == free - 1
    pair.step([1, 0], [3, 12])  # both cross into new blocks
    pair.fork(1, 2)
    pair.step([2, 1, 0], [1, 1, 1])
    pair.check_contents()


def test_fork_errors():
    kv = paged_manager()
    kv.add_sequence(0)
    with pytest.raises(KVCoreError):
        kv.fork_sequence(0, 0)
    with pytest.raises(KVCoreError):
        kv.fork_sequence(5, 6)


# -- out of blocks ---------------------------------------------------------------------------------------


def _snapshot(kv):
    layers = kv.cache.spec.num_layers
    return {
        s: (kv.seq_len(s), kv.blocks.block_table(s), [t.clone() for layer in range(layers) for t in kv.read(layer, s)])
        for s in kv.blocks.seq_ids
    }


def _assert_same(kv, snap, free):
    assert kv.blocks.num_free_blocks == free
    assert set(kv.blocks.seq_ids) == set(snap)
    for s, (n, table, tensors) in snap.items():
        assert kv.seq_len(s) == n and kv.blocks.block_table(s) == table
        now = [t for layer in range(kv.cache.spec.num_layers) for t in kv.read(layer, s)]
        assert all(torch.equal(a, b) for a, b in zip(now, tensors))


def test_out_of_blocks_leaves_every_sequence_intact():
    bs = 4
    kv = paged_manager(block_size=bs, num_blocks=6, max_seq_len=100)
    for s in range(3):
        kv.add_sequence(s)
    meta = kv.prepare([0, 1, 2], [5, 4, 3], 1.0)  # 2 + 1 + 1 blocks: 2 left
    kv.cache.write(0, torch.randn(12, 2, 32), torch.randn(12, 2, 32), meta)
    kv.fork_sequence(0, 3)  # shares seq 0's partly filled last block
    snap, free = _snapshot(kv), kv.blocks.num_free_blocks
    assert free == 2

    # one sequence alone does not fit: caught by the per-sequence check
    assert not kv.blocks.can_append(1, 13)
    with pytest.raises(OutOfBlocksError):
        kv.prepare([1, 2], [1, 13], 1.0)
    _assert_same(kv, snap, free)

    # each fits alone but not together: 1 (seq 1) + 1 (seq 2) + 1 copy-on-write (seq 3) > 2
    assert all(kv.blocks.can_append(s, n) for s, n in [(1, 1), (2, 2), (3, 1)])
    assert not kv.can_reserve([1, 2, 3], [1, 2, 1])
    with pytest.raises(OutOfBlocksError):
        kv.prepare([1, 2, 3], [1, 2, 1], 1.0)
    _assert_same(kv, snap, free)

    # past max_seq_len is a context-length error, also without side effects
    with pytest.raises(ContextLengthError):
        kv.prepare([2], [98], 1.0)
    _assert_same(kv, snap, free)

    assert kv.can_reserve([1, 2], [1, 2])
    kv.prepare([1, 2], [1, 2], 1.0)
    assert kv.blocks.num_free_blocks == 0
    assert not kv.can_add_sequence()


def test_add_sequence_to_a_full_pool_is_refused():
    kv = paged_manager(block_size=4, num_blocks=2)
    kv.add_sequence(0)
    kv.prepare([0], [8], 1.0)
    assert not kv.can_add_sequence()
    try:
        kv.add_sequence(9)
    except OutOfBlocksError:
        assert not kv.blocks.has_sequence(9)
        return
    raise AssertionError("add_sequence on a full pool did not raise OutOfBlocksError")


# -- allocator -------------------------------------------------------------------------------------------


def test_block_allocator():
    from kvcore.scheduling.block_pool import BlockAllocator

    alloc = BlockAllocator(3)
    a, b, c = alloc.allocate(), alloc.allocate(), alloc.allocate()
    assert sorted([a, b, c]) == [0, 1, 2] and alloc.num_free_blocks == 0 and not alloc.can_allocate(1)
    with pytest.raises(OutOfBlocksError):
        alloc.allocate()
    alloc.incref(b)
    assert alloc.ref_count(b) == 2
    alloc.free(b)
    assert alloc.ref_count(b) == 1 and alloc.num_free_blocks == 0
    alloc.free(b)
    assert alloc.is_free(b) and alloc.can_allocate(1) and not alloc.can_allocate(2)
    with pytest.raises(KVCoreError, match="double free"):
        alloc.free(b)
    with pytest.raises(KVCoreError):
        alloc.incref(b)  # sharing a free block is refused (only a prefix-cache hit may revive it)
    with pytest.raises(KVCoreError):
        alloc.ref_count(3)
    assert alloc.allocate() == b
    with pytest.raises(ConfigError):
        BlockAllocator(0)


# -- options and registration ----------------------------------------------------------------------------


def test_block_size_option_overrides_the_spec():
    spec = make_spec(block_size=16)
    cache = PagedKVCache(spec, block_size=32)
    assert isinstance(cache, PagedKVCache) and cache.block_size == 32 and cache.spec.block_size == 32
    assert PagedKVCache(spec).block_size == 16
    created = get_registry().create_cache("paged", spec, {"block_size": 32})
    assert isinstance(created, PagedKVCache) and created.block_size == 32
    assert KVCacheManager(created).blocks.block_size == 32


def test_block_size_option_from_the_engine_config(random_model):
    """``[kv_caches.paged] block_size`` (was the paged backend's option) reaches the cache and its blocks."""
    config = EngineConfig(backend="paged", max_model_len=64, kv_cache_options={"paged": {"block_size": 32}})
    engine = Engine(random_model, None, config)
    assert engine.cache.block_size == 32 and engine.kv.blocks.block_size == 32
    # and it generates what the oracle does, across a block boundary (45 + 4 tokens > 32)
    prompt, params = [1, 5, 9] * 15, SamplingParams(max_new_tokens=4, ignore_eos=True)
    naive = Engine(random_model, None, EngineConfig(backend="naive", max_model_len=64))
    assert engine.generate([prompt], params)[0].token_ids == naive.generate([prompt], params)[0].token_ids
    for block_size, expected in ((None, 16), (8, 8)):
        extra = {} if block_size is None else {"block_size": block_size}
        other = Engine(random_model, None, EngineConfig(backend="paged", max_model_len=64, **extra))
        assert other.cache.block_size == expected == other.kv.blocks.block_size
    with pytest.raises(ConfigError, match="block_size"):
        Engine(random_model, None, EngineConfig(backend="paged", kv_cache_options={"paged": {"block_size": 0}}))


@pytest.mark.parametrize("bad", [0, -4, 1.5, "16", True])
def test_invalid_block_size_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="block_size"):
        PagedKVCache(make_spec(), block_size=bad)
    with pytest.raises(ConfigError, match="block_size"):
        get_registry().create_cache("paged", make_spec(), {"block_size": bad})


def test_unknown_options_are_config_errors():
    with pytest.raises(ConfigError):
        PagedBackend(blocksize=16)
    with pytest.raises(ConfigError, match="block_size"):
        PagedBackend(block_size=16)  # moved to the cache
    with pytest.raises(ConfigError, match="decode_impl"):
        PagedBackend(decode_impl="flex")  # the flex decode path is gone
    with pytest.raises(ConfigError, match="blocksize"):
        PagedKVCache(make_spec(), blocksize=16)


def test_registered_as_a_plugin():
    registry = PluginRegistry(
        load_entrypoints=False,
        builtins=("kvcore.backends.contiguous", "kvcore.backends.naive", "kvcore.backends.paged"),
    )
    entry = registry.get("paged")
    assert entry.cls is PagedBackend and entry.plugin == "kvcore.backends.paged"
    assert PagedBackend.priority == 5 and PagedBackend.capabilities.kv_layouts == ("paged",)
    cache_entry = registry.get("paged", KV_CACHE)
    assert cache_entry.cls is PagedKVCache and cache_entry.plugin == "kvcore.backends.paged"
    assert PagedKVCache.layout == "paged" and PagedKVCache.paged
    cache = registry.create_cache("paged", make_spec(), {"block_size": 8})
    assert cache.block_size == 8
    backend = registry.create("paged")
    assert backend.validate(device=CPU, dtype=torch.bfloat16, head_dim=64, num_heads=9, num_kv_heads=3) == []
