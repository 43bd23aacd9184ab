"""Sliding-window layers give KV blocks back to the pool (kvcore/scheduling/kv_groups.py): streams are the
same with the window pool on and off, blocks are given back exactly when no later query reads them, and
prefix caching, forks, preemption and aborts keep the pool consistent."""

from __future__ import annotations

import pytest
from helpers import make_random_gemma3

import kvcore.scheduling.block_manager as block_manager
from kvcore import Engine, EngineConfig, LlamaModel, SamplingParams
from kvcore.errors import KVCoreError
from kvcore.interfaces.layer_attention import LayerAttention
from kvcore.scheduling.block_manager import BlockManager
from kvcore.scheduling.kv_groups import first_live_block, group_layers

WINDOW = 7


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return make_random_gemma3(window=WINDOW)


PROMPTS = [[(7 * i + 3) % 290 + 5 for i in range(23)], [40, 41, 42, 43, 44], list(range(100, 117))]
PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=0)


def run(model, prompts=PROMPTS, params=PARAMS, **config):
    engine = Engine(model, None, EngineConfig(backend="paged", dtype="float32", max_model_len=96, **config))
    results = engine.generate(prompts, params)
    assert engine.kv.blocks.num_free_blocks == engine.kv.blocks.num_blocks  # no block leaked
    return engine, results


def assert_same_streams(got, want):
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


# -- grouping and the window rule ---------------------------------------------------------------------------
def test_gemma3_270m_layers_group_by_type_into_equal_groups():
    # the real 270M: 18 layers, every sixth global, window 512
    layers = [LayerAttention(1.0, None if (i + 1) % 6 == 0 else 512) for i in range(18)]
    groups = group_layers(layers, 18, 8192, free_window_blocks=True)
    assert [g.window for g in groups.groups] == [None] + [512] * 5
    assert groups.groups[0].layers == (5, 11, 17) and groups.groups[1].layers == (0, 1, 2)
    assert sorted(layer for g in groups.groups for layer in g.layers) == list(range(18))
    # three storage layers: each group's layers on distinct ones, so a block id holds one group's K/V
    for g in groups.groups:
        assert sorted(groups.layer_storage[layer] for layer in g.layers) == [0, 1, 2]
    assert groups.layer_groups[:6] == (1, 1, 1, 2, 2, 0)
    # a window no sequence reaches hides nothing; off: one group of every layer
    assert len(group_layers(layers, 18, 512, free_window_blocks=True).groups) == 1
    assert group_layers(layers, 18, 8192, free_window_blocks=False).layer_storage is None


@pytest.mark.parametrize("position, window, block_size, first", [
    (0, 7, 4, 0), (7, 7, 4, 0), (8, 7, 4, 0), (10, 7, 4, 1), (11, 7, 4, 1), (14, 7, 4, 2), (9, 1, 4, 2),
    (100, None, 4, 0), (16, 8, 8, 1), (15, 8, 8, 1), (14, 8, 8, 0),
])
def test_first_live_block_is_the_block_of_the_oldest_visible_key(position, window, block_size, first):
    assert first_live_block(position, window, block_size) == first
    if window is not None and position - window + 1 >= 0:  # the oldest key the query sees is in that block
        assert (position - window + 1) // block_size == first


def test_slide_gives_back_dead_blocks_and_a_rollback_never_needs_them():
    m = BlockManager(32, 4, 64, windows=(None, WINDOW))
    m.add_sequence(0)
    m.reserve([0], [18])
    m.slide(0, 18)  # the next query at 18 sees 12..18: blocks 0-2 (tokens 0-11) are dead for the window group
    assert [len(b) for b in m.held_blocks(0)] == [5, 2]
    assert m.num_tokens_held(0) == [18, 6] and m.block_table(0, 1)[:3] == [0, 0, 0]
    assert m.num_free_blocks == 32 - 7
    m.reserve([0], [3])
    m.truncate(0, 18)  # a failed forward rolls back to the committed tokens: their window is all there
    with pytest.raises(KVCoreError, match="given back"):
        m.truncate(0, 10)
    m.free_sequence(0)
    assert m.num_free_blocks == 32


def test_a_fork_shares_window_blocks_and_each_sequence_slides_on_its_own():
    m = BlockManager(32, 4, 64, windows=(None, WINDOW))
    m.add_sequence(0)
    m.reserve([0], [10])
    m.fork_sequence(0, 1)
    assert m.num_blocks_needed([0, 1], [1, 1]) == 2  # per group one copy of the shared last block (the last
    # holder writes in place)
    m.reserve([0, 1], [6, 1])
    m.slide(0, 16)
    assert m.num_tokens_held(0) == [16, 8] and m.num_tokens_held(1) == [11, 11]
    m.free_sequence(1)
    m.free_sequence(0)
    assert m.num_free_blocks == 32


# -- prefix caching ------------------------------------------------------------------------------------------
def computed(m: BlockManager, seq_id: int, tokens: list[int]) -> int:
    cached = m.add_sequence(seq_id, tokens)
    m.reserve([seq_id], [len(tokens) - cached])
    m.commit(seq_id, tokens)
    m.slide(seq_id, len(tokens))
    return cached


def test_a_prefix_hit_takes_a_window_group_s_live_blocks_only():
    m = BlockManager(64, 4, 64, enable_prefix_caching=True, windows=(None, WINDOW))
    tokens = list(range(1, 22))  # 5 full blocks and one token
    computed(m, 0, tokens)
    m.free_sequence(0)
    assert m.add_sequence(1, tokens) == 20  # the next query at 20 reads 14..20: blocks 3, 4 and the new one
    held = m.held_blocks(1)
    assert len(held[0]) == 5 and len(held[1]) == 2 and m.block_table(1, 1)[:3] == [0, 0, 0]


def test_a_prefix_hit_never_hands_out_window_blocks_given_back_and_reused():
    m = BlockManager(14, 4, 64, enable_prefix_caching=True, windows=(None, WINDOW))
    tokens = list(range(1, 22))
    m.add_sequence(0, tokens)
    m.reserve([0], [21])
    m.commit(0, tokens)
    window_blocks = m.block_table(0, 1)
    m.slide(0, 21)  # gives back window blocks 0-2 (free, they keep their keys)
    computed(m, 1, list(range(500, 508)))  # takes 4 free blocks, given-back window blocks among them
    reused = {b for table in m.held_blocks(1) for b in table}
    assert reused & set(window_blocks[:3])
    # the full-attention group still holds blocks 0-2 of `tokens` (a 12-token hit for it alone); a hit of n
    # blocks also needs the window blocks a query at 4n reads, none of them overwritten
    hit = m.add_sequence(2, tokens[:13])
    want = max(n for n in range(4) if not set(window_blocks[first_live_block(4 * n, WINDOW, 4) : n]) & reused)
    assert hit == 4 * want < 12
    assert not {b for table in m.held_blocks(2) for b in table} & reused
    m.free_sequence(2)
    # at 20 the window reads blocks 3 and 4 only, both intact
    assert m.add_sequence(3, tokens) == 20
    assert m.held_blocks(3) == [m.held_blocks(0)[0][:5], m.held_blocks(0)[1][:2]]


# -- through the engine: streams identical with the pool on and off -----------------------------------------
@pytest.mark.parametrize("block_size, chunk", [(4, 3), (4, 64), (7, 7), (8, 5), (16, 9)],
                         ids=["bs4-chunk3", "bs4-whole", "bs=window", "bs8-chunk5", "bs16-chunk9"])
def test_streams_are_the_same_with_the_window_pool_on_and_off(model, block_size, chunk):
    config = dict(block_size=block_size, max_num_batched_tokens=chunk)
    on, got = run(model, free_window_blocks=True, **config)
    off, want = run(model, free_window_blocks=False, **config)
    assert on.kv.window_pool == "on" and off.kv.window_pool.startswith("off")
    assert_same_streams(got, want)
    # the longest sequence decoded far past the window: its window layers held the window only
    peak_on, peak_off = got[0].metrics.kv_bytes, want[0].metrics.kv_bytes
    assert peak_on < peak_off


def test_decode_past_the_window_from_a_prompt_shorter_than_it(model):
    prompts, params = [[9, 8, 7]], SamplingParams(max_new_tokens=40, ignore_eos=True, logprobs=0)
    on, got = run(model, prompts, params, block_size=4)
    _, want = run(model, prompts, params, block_size=4, free_window_blocks=False)
    assert_same_streams(got, want)


def test_prefix_caching_and_forked_samples_with_windows(model):
    shared = list(range(60, 90))
    prompts = [shared + [5], shared + [6, 7]]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, n=2, temperature=0.8, seed=3, logprobs=0)
    config = dict(block_size=4, enable_prefix_caching=True, max_num_batched_tokens=8)
    on, got = run(model, prompts, params, **config)
    _, want = run(model, prompts, params, **{**config, "free_window_blocks": False})
    assert_same_streams(got, want)
    assert on.stats.num_cached_tokens > 0  # the second prompt hit the first's blocks


def test_preempted_requests_recompute_the_same_streams(model):
    config = dict(block_size=4, max_num_batched_tokens=16)
    tight, got = run(model, num_blocks=48, **config)
    _, want = run(model, free_window_blocks=False, **config)
    assert tight.stats.num_preemptions > 0
    assert_same_streams(got, want)


def test_aborted_and_finished_requests_leave_no_block_behind(model):
    engine = Engine(model, None, EngineConfig(backend="paged", dtype="float32", max_model_len=96, block_size=4))
    ids = [engine.add_request(p, PARAMS) for p in PROMPTS]
    for _ in range(6):
        engine.step()
    engine.abort(ids[0])
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.blocks.num_free_blocks == engine.kv.blocks.num_blocks
    assert engine.kv.blocks.num_tokens_in_use == 0


def test_speculative_drafts_rolled_back_past_the_window(model):
    """Rejected drafts are truncated away; the window slid only from committed tokens, so none is missing."""
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], PROMPTS[0]]  # repeats: the n-gram proposer drafts
    config = dict(block_size=4, proposer="ngram", num_speculative_tokens=3)
    on, got = run(model, prompts, **config)
    _, want = run(model, prompts, block_size=4, free_window_blocks=False)
    assert_same_streams(got, want)
    assert on.stats.num_draft_tokens > 0


def test_int8_cache_shares_storage_layers_too(model):
    _, got = run(model, block_size=4, kv_cache="int8")
    _, want = run(model, block_size=4, kv_cache="int8", free_window_blocks=False)
    assert_same_streams(got, want)


def test_a_block_given_back_one_too_early_is_caught(model, monkeypatch):
    _, want = run(model, block_size=4, free_window_blocks=False)
    monkeypatch.setattr(block_manager, "first_live_block", lambda pos, w, bs: first_live_block(pos, w, bs) + 1)
    _, got = run(model, block_size=4)
    with pytest.raises(AssertionError):
        assert_same_streams(got, want)


# -- accounting -----------------------------------------------------------------------------------------------
def test_capacity_and_kv_bytes_count_the_given_back_blocks(model):
    budget = dict(backend="paged", dtype="float32", max_model_len=96, block_size=4, kv_cache_bytes=100 * 6144)
    on = Engine(model, None, EngineConfig(**budget))
    off = Engine(model, None, EngineConfig(**budget, free_window_blocks=False))
    per_layer_token = 2 * 2 * 16 * 4  # K and V, 2 KV heads, head_dim 16, float32
    a, b = on.kv.capacity(), off.kv.capacity()
    assert b.seq_bytes == b.seq_bytes_all_layers == 96 * 6 * per_layer_token
    # one global layer keeps 96 tokens; five window layers keep the blocks the next query reads (88..95)
    assert a.seq_bytes == (96 + 5 * (96 - first_live_block(96, WINDOW, 4) * 4)) * per_layer_token
    assert a.seq_bytes_all_layers == b.seq_bytes
    assert a.block_bytes * 6 == b.block_bytes  # a block id holds one layer per group here
    assert a.num_blocks * a.block_bytes == b.num_blocks * b.block_bytes == 100 * 6144
    assert a.num_seqs >= 3 * b.num_seqs  # the same bytes hold several times the sequences
    assert on.serving_config()["window_pool"] == "on"
    # a live sequence's kv_bytes: its held tokens per group
    on.kv.add_sequence(0)
    on.kv.prepare([0], [30], 1.0)
    on.kv.blocks.slide(0, 30)
    assert on.kv.kv_bytes_in_use(0) == (30 + 5 * (30 - first_live_block(30, WINDOW, 4) * 4)) * per_layer_token


def test_a_cache_without_the_window_pool_says_why(model):
    engine = Engine(model, None, EngineConfig(backend="sdpa", dtype="float32", max_model_len=96))
    assert engine.kv.window_pool.startswith("off: KV cache 'contiguous': one slot of max_seq_len")
