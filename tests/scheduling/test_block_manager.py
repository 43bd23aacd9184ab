"""The core's block bookkeeping: allocation order, copy-on-write, prefix caching and all-or-nothing errors.

:class:`~kvcore.scheduling.block_manager.BlockManager` is tested on its own (no storage), then through a
:class:`~kvcore.scheduling.kv_manager.KVCacheManager` where a cache must see the copies, and finally in the engine:
prefix caching must change what is computed, never what is generated.
"""

from __future__ import annotations

import pytest
import torch

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.backends.contiguous import ContiguousKVCache
from kvcore.backends.paged import PagedKVCache
from kvcore.backends.quantized import Int8KVCache
from kvcore.conformance.models import get_model
from kvcore.errors import ContextLengthError, KVCoreError, OutOfBlocksError
from kvcore.interfaces.kv_cache import CacheSpec
from kvcore.scheduling.block_manager import BlockManager
from kvcore.scheduling.kv_manager import KVCacheManager

BS = 4  # tokens per block in the unit tests


def spec(*, max_num_seqs=4, max_seq_len=64, block_size=BS, num_blocks=None) -> CacheSpec:
    return CacheSpec(
        num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"),
        max_num_seqs=max_num_seqs, max_seq_len=max_seq_len, block_size=block_size, num_blocks=num_blocks,
    )


def state(m: BlockManager):
    """Everything reserve() could change: tables, lengths, reference counts, the free count."""
    alloc = m.allocator
    return (
        {s: (m.seq_len(s), m.block_table(s)) for s in m.seq_ids},
        [alloc.ref_count(b) for b in range(m.num_blocks)],
        m.num_free_blocks,
    )


def computed(m: BlockManager, seq_id: int, token_ids: list[int]) -> None:
    """Start ``seq_id`` with ``token_ids``, reserve what the prefix cache did not cover, and commit
    (what the engine does once a prefill's K/V are written)."""
    cached = m.add_sequence(seq_id, token_ids)
    m.reserve([seq_id], [len(token_ids) - cached])
    m.commit(seq_id, token_ids)


# -- allocation order --------------------------------------------------------------------------------------


def test_slot_layouts_allocate_lowest_first_and_paged_layouts_lru():
    assert BlockManager(4, 64, 64).allocator.lowest_first  # one block = one slot of max_seq_len
    assert not BlockManager(16, BS, 64).allocator.lowest_first
    assert KVCacheManager(ContiguousKVCache(spec())).blocks.allocator.lowest_first
    assert not KVCacheManager(PagedKVCache(spec())).blocks.allocator.lowest_first

    # paged: least recently freed first
    m = BlockManager(4, BS, 64)
    for s in range(4):
        m.add_sequence(s)
        m.reserve([s], [1])
    for s in (2, 0, 3):
        m.free_sequence(s)
    m.add_sequence(9)
    m.reserve([9], [3 * BS])
    assert m.block_table(9) == [2, 0, 3]


def test_a_batch_keeps_consecutive_slots_after_churn():
    kv = KVCacheManager(ContiguousKVCache(spec(max_num_seqs=6)))
    for s in range(6):
        kv.add_sequence(s)
    kv.prepare(list(range(6)), [3] * 6, 1.0)
    assert [kv.blocks.block_table(s) for s in range(6)] == [[s] for s in range(6)]
    for s in (4, 1, 0, 5):  # free out of order: least recently freed would be 4, then 1
        kv.free_sequence(s)
    for s in (10, 11, 12):
        kv.add_sequence(s)
    meta = kv.prepare([10, 11, 12, 2], [2, 2, 2, 1], 1.0)
    assert meta.slots == [0, 1, 4, 2]  # the lowest free slots, in order
    kv.free_sequence(12)
    kv.add_sequence(13)
    meta = kv.prepare([10, 11, 2, 3, 13], [1] * 5, 1.0)
    assert sorted(meta.slots) == list(range(5))  # the batch sits on consecutive slots


# -- copy-on-write -------------------------------------------------------------------------------------------


def test_reserve_returns_the_copy_on_write_pairs():
    m = BlockManager(10, BS, 64)
    m.add_sequence(0)
    m.reserve([0], [BS + 2])  # one full block, one with 2 tokens
    full, last = m.block_table(0)
    m.fork_sequence(0, 1)
    m.fork_sequence(0, 2)
    assert [m.allocator.ref_count(b) for b in (full, last)] == [3, 3]
    free = m.num_free_blocks
    assert m.num_blocks_needed([0, 1, 2], [1, 1, 1]) == 2  # three writers of a 3-holder block: 2 copies

    copies = m.reserve([1, 0, 2], [1, 1, 1])
    assert len(copies) == 2 and all(src == last for src, _ in copies)
    new = [dst for _, dst in copies]
    assert len(set(new)) == 2 and last not in new and full not in new
    assert m.block_table(1) == [full, new[0]] and m.block_table(0) == [full, new[1]]
    assert m.block_table(2) == [full, last]  # the last holder writes in place
    assert [m.allocator.ref_count(b) for b in (full, last, *new)] == [3, 1, 1, 1]
    assert m.num_free_blocks == free - 2
    assert m.reserve([0, 1, 2], [1, 1, 1]) == []  # nothing shared is written any more

    # a block-aligned fork writes into a fresh block: no copy
    m.add_sequence(5)
    m.reserve([5], [2 * BS])
    m.fork_sequence(5, 6)
    assert m.num_blocks_needed([5, 6], [1, 1]) == 2 and m.reserve([5, 6], [1, 1]) == []


def test_prepare_has_the_cache_copy_before_the_call():
    cache = PagedKVCache(spec(num_blocks=8))
    seen = []
    original = cache.copy_blocks
    cache.copy_blocks = lambda pairs: (seen.append(list(pairs)), original(pairs))
    kv = KVCacheManager(cache)
    kv.add_sequence(0)
    meta = kv.prepare([0], [3], 1.0)
    cache.write(0, torch.ones(3, 1, 2), -torch.ones(3, 1, 2), meta)
    kv.fork_sequence(0, 1)
    shared = kv.blocks.block_table(0)[0]
    meta = kv.prepare([1], [1], 1.0)
    (child,) = kv.blocks.block_table(1)
    assert seen == [[(shared, child)]] and meta.block_tables == [[child]]
    assert torch.equal(kv.read(0, 1)[0][:3], torch.ones(3, 1, 2))  # the copy is there before the write
    kv.prepare([0], [1], 1.0)
    assert len(seen) == 1  # the parent now holds its block alone


# -- prefix caching ------------------------------------------------------------------------------------------

PROMPT = list(range(100, 100 + 3 * BS))  # exactly 3 blocks


def test_same_prompt_shares_full_blocks_but_never_the_last_tokens_block():
    m = BlockManager(16, BS, 64, enable_prefix_caching=True)
    computed(m, 0, PROMPT)
    first = m.block_table(0)
    assert len(first) == 3

    assert m.add_sequence(1, PROMPT) == 2 * BS  # block 3 holds the last token: its logits are needed
    assert m.block_table(1) == first[:2] and m.seq_len(1) == 2 * BS
    assert [m.allocator.ref_count(b) for b in first] == [2, 2, 1]
    free = m.num_free_blocks
    assert m.reserve([1], [BS]) == []
    assert m.block_table(1)[:2] == first[:2] and m.block_table(1)[2] != first[2]
    assert m.num_free_blocks == free - 1

    # one token more and all three full blocks are shared
    assert m.add_sequence(2, PROMPT + [7]) == 3 * BS
    assert m.block_table(2) == first
    # a prompt shorter than a block, or of exactly one block, shares nothing
    assert m.add_sequence(3, PROMPT[:BS]) == 0 and m.add_sequence(4, PROMPT[:1]) == 0
    # a diverging block ends the match
    assert m.add_sequence(5, PROMPT[:BS] + [1] * BS + PROMPT[2 * BS :] + [7]) == BS


def test_hash_chain_a_different_first_block_means_no_sharing():
    m = BlockManager(16, BS, 64, enable_prefix_caching=True)
    computed(m, 0, PROMPT + [7])
    other = [1] + PROMPT[1:] + [7]  # blocks 2 and 3 equal PROMPT's, block 1 does not
    assert m.add_sequence(1, other) == 0 and m.block_table(1) == []
    computed(m, 2, [5] * BS + PROMPT[BS:] + [7])  # same later blocks behind another first block
    assert not set(m.block_table(2)) & set(m.block_table(0))
    # a block cached only behind another parent is not shared either: its K/V depend on all before it
    computed(m, 3, [5] * BS + [6] * BS + [7])
    assert m.add_sequence(4, PROMPT[:BS] + [6] * BS + [7]) == BS
    assert m.block_table(4) == m.block_table(0)[:1]


def test_without_prefix_caching_nothing_is_shared():
    m = BlockManager(16, BS, 64)
    computed(m, 0, PROMPT + [7])
    assert m.add_sequence(1, PROMPT + [7]) == 0 and m.block_table(1) == []


def test_a_freed_block_is_revived_by_a_later_match():
    m = BlockManager(8, BS, 64, enable_prefix_caching=True)
    computed(m, 0, PROMPT + [7])
    table = m.block_table(0)
    m.free_sequence(0)
    assert m.num_free_blocks == 8 and all(m.allocator.is_free(b) for b in table)
    assert m.add_sequence(1, PROMPT + [9]) == 3 * BS
    assert m.block_table(1) == table[:3]
    assert [m.allocator.ref_count(b) for b in table[:3]] == [1, 1, 1]
    assert m.num_free_blocks == 8 - 3  # revived blocks left the free list
    m.reserve([1], [1])
    assert m.num_free_blocks == 8 - 4


def test_a_block_handed_out_again_loses_its_hash_lru():
    m = BlockManager(8, BS, 64, enable_prefix_caching=True)
    computed(m, 0, [1] * (2 * BS + 1))  # blocks 0..2
    computed(m, 1, PROMPT + [7])  # blocks 3..6; block 7 never used
    chain = m.block_table(1)[:3]  # seq 1's three hashed blocks
    m.free_sequence(0)  # free list: 7, then seq 0's blocks
    m.free_sequence(1)  # then seq 1's: the most recently freed are evicted last
    m.add_sequence(2)
    m.reserve([2], [4 * BS])  # takes 7 and seq 0's three blocks
    assert m.add_sequence(3, [1] * (2 * BS + 1)) == 0  # evicted: handed out again, hash gone
    assert m.add_sequence(4, PROMPT + [7]) == 3 * BS  # still cached
    assert m.block_table(4) == chain
    m.free_sequence(4)  # free list: seq 1's unhashed last block, then the revived chain again

    m.add_sequence(5)
    m.reserve([5], [1])  # takes the unhashed block: the chain survives
    assert m.add_sequence(6, PROMPT + [7]) == 3 * BS
    m.free_sequence(6)
    m.reserve([5], [BS])  # the next least recently freed block is one of the chain's
    evicted = m.block_table(5)[1]
    assert evicted in chain
    # the match stops at the evicted block (today blocks are freed head first, so it is the chain's first)
    assert m.add_sequence(7, PROMPT + [7]) == BS * chain.index(evicted)
    assert m.block_table(7) == chain[: chain.index(evicted)]


def test_commit_is_incremental_and_only_covers_written_tokens():
    m = BlockManager(16, BS, 64, enable_prefix_caching=True)
    tokens = list(range(200, 200 + 4 * BS))
    m.add_sequence(0, tokens[: BS + 1])
    m.reserve([0], [BS + 1])
    assert m.add_sequence(1, tokens) == 0  # nothing committed yet
    m.free_sequence(1)

    m.commit(0, tokens[: BS + 1])
    assert m.add_sequence(1, tokens) == BS
    m.free_sequence(1)

    m.reserve([0], [BS - 1])  # now 2 full blocks are written
    m.commit(0, tokens)  # more ids than written: only the 2 written blocks are hashed
    assert m.add_sequence(1, tokens + [1]) == 2 * BS
    m.free_sequence(1)

    m.reserve([0], [2 * BS])
    m.commit(0, tokens)
    m.commit(0, tokens)  # idempotent
    assert m.add_sequence(1, tokens + [1]) == 4 * BS
    assert m.block_table(1) == m.block_table(0)


def test_forked_sequences_commit_the_same_blocks_once():
    m = BlockManager(16, BS, 64, enable_prefix_caching=True)
    computed(m, 0, PROMPT[: 2 * BS - 1])
    m.fork_sequence(0, 1)
    for s, extra in ((0, [1, 1]), (1, [2, 2])):
        m.reserve([s], [2])
        m.commit(s, PROMPT[: 2 * BS - 1] + extra)
    assert m.add_sequence(2, PROMPT[: 2 * BS - 1] + [1, 9]) == 2 * BS
    assert m.block_table(2) == m.block_table(0)[:2]
    assert m.add_sequence(3, PROMPT[: 2 * BS - 1] + [2, 9]) == 2 * BS
    assert m.block_table(3) == m.block_table(1)[:2]  # the child's copy-on-write block, its own content


# -- errors ----------------------------------------------------------------------------------------------------


def test_past_max_seq_len_is_a_context_length_error_without_side_effects():
    m = BlockManager(64, BS, 20)
    m.add_sequence(0)
    m.reserve([0], [18])
    m.add_sequence(1)
    before = state(m)
    assert not m.can_reserve([0], [3]) and m.can_reserve([0], [2])
    with pytest.raises(ContextLengthError, match="max_seq_len 20"):
        m.reserve([1, 0], [1, 3])
    with pytest.raises(ContextLengthError):
        m.reserve([1], [21])
    assert state(m) == before
    m.reserve([0, 1], [2, 20])
    assert m.seq_len(0) == m.seq_len(1) == 20


def test_out_of_blocks_is_all_or_nothing():
    m = BlockManager(6, BS, 64, enable_prefix_caching=True)
    computed(m, 0, PROMPT[: BS + 2])  # 2 blocks
    m.fork_sequence(0, 1)  # shares the partly filled block
    m.add_sequence(2)
    m.reserve([2], [BS])  # 1 block: 3 free
    before = state(m)
    # seq 2: 1 block, seq 1: 1 copy-on-write copy, seq 0: 2 blocks (writes its block in place) = 4 > 3
    assert m.num_blocks_needed([2, 1, 0], [1, 1, 2 * BS]) == 4
    assert not m.can_reserve([2, 1, 0], [1, 1, 2 * BS])
    assert all(m.can_append(s, n) for s, n in ((2, 1), (1, 1), (0, 2 * BS)))  # each fits alone
    with pytest.raises(OutOfBlocksError, match="needs 4 more blocks, only 3 free"):
        m.reserve([2, 1, 0], [1, 1, 2 * BS])
    assert state(m) == before
    assert m.add_sequence(3, PROMPT[: BS + 2]) == BS  # the prefix cache is intact too
    m.free_sequence(3)
    assert m.reserve([2, 1], [1, 1]) and m.num_free_blocks == 1


def test_bad_calls_are_refused():
    m = BlockManager(8, BS, 64)
    m.add_sequence(0)
    with pytest.raises(KVCoreError, match="already"):
        m.add_sequence(0)
    with pytest.raises(KVCoreError, match="not in the KV cache"):
        m.reserve([7], [1])
    with pytest.raises(KVCoreError, match="twice"):
        m.reserve([0, 0], [1, 1])
    with pytest.raises(KVCoreError, match="positive"):
        m.reserve([0], [0])
    with pytest.raises(KVCoreError):
        m.reserve([0], [1, 2])
    with pytest.raises(KVCoreError):
        m.reserve([], [])
    assert m.seq_len(0) == 0 and m.num_free_blocks == 8
    m.free_sequence(0)
    with pytest.raises(KVCoreError):
        m.free_sequence(0)


@pytest.mark.parametrize("cache_cls", [
    PagedKVCache,
    Int8KVCache,
    ContiguousKVCache,
])
def test_read_of_an_empty_sequence(cache_cls):
    kv = KVCacheManager(cache_cls(spec()))
    kv.add_sequence(0)
    k, v = kv.read(0, 0)
    assert k.shape == v.shape == (0, 1, 2)


# -- the engine --------------------------------------------------------------------------------------------

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return get_model("tiny", torch.float32, "cpu").model


def shared_prefix_prompts() -> list[list[int]]:
    common = [(7 * i) % 500 + 3 for i in range(40)]  # 2.5 blocks of 16
    return [common + [11 + j, 23 + j, 37 + j, 41 + j, 53 + j] for j in range(4)]


def test_engine_prefix_caching_changes_nothing_but_the_work(tiny):
    prompts = shared_prefix_prompts()
    plain = Engine(tiny, None, EngineConfig(backend="paged", max_model_len=128))
    expected = [plain.generate([p], GREEDY)[0].token_ids for p in prompts]

    engine = Engine(tiny, None, EngineConfig(backend="paged", max_model_len=128, enable_prefix_caching=True))
    results = [engine.generate([p], GREEDY)[0] for p in prompts]  # one after another: earlier blocks committed
    assert [r.token_ids for r in results] == expected
    assert results[0].metrics.num_cached_tokens == 0
    # the 2 full blocks of the common 40-token prefix; the third holds each prompt's own tokens
    assert [r.metrics.num_cached_tokens for r in results[1:]] == [32, 32, 32]
    assert engine.kv.blocks.num_free_blocks == engine.kv.blocks.num_blocks
    assert len({tuple(t) for t in expected}) > 1  # the prompts' own tokens matter


def test_engine_prefix_caching_under_preemption_keeps_streams(tiny):
    """A tight pool preempts; re-admitted requests revive their own cached blocks; streams do not change."""
    prompts = shared_prefix_prompts()
    # 20 blocks: the shared prefix (10 blocks) is computed once, so only a pool this tight still preempts
    config = dict(backend="paged", block_size=4, num_blocks=20, max_model_len=128)
    expected = [r.token_ids for r in Engine(tiny, None, EngineConfig(**config)).generate(prompts, GREEDY)]
    engine = Engine(tiny, None, EngineConfig(**config, enable_prefix_caching=True))
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    assert sum(r.metrics.num_preemptions for r in results) > 0
    assert sum(r.metrics.num_cached_tokens for r in results) > 0
    assert engine.kv.blocks.num_free_blocks == 20


def test_truncate_rolls_a_reservation_back():
    m = BlockManager(16, BS, 64, enable_prefix_caching=True)
    tokens = list(range(300, 300 + 3 * BS))
    computed(m, 0, tokens[: 2 * BS + 1])  # 3 blocks, 2 full ones committed
    before = state(m)
    m.reserve([0], [2 * BS])  # a forward that will fail: 2 more blocks
    assert m.num_free_blocks == before[2] - 2
    m.truncate(0, 2 * BS + 1)
    assert state(m) == before
    m.truncate(0, BS)  # below the committed blocks: the next commit re-walks the chain
    assert m.block_table(0) == before[0][0][1][:1] and m.num_free_blocks == before[2] + 2
    m.reserve([0], [2 * BS])
    m.commit(0, tokens)
    assert m.add_sequence(1, tokens + [1]) == 3 * BS  # every full block hashed again
    with pytest.raises(KVCoreError, match="cannot truncate"):
        m.truncate(0, 4 * BS)
