"""Prefix caching never answers one request from another request's K/V.

Block keys are SHA-256 chained over the parent key and the token bytes, rooted in what else makes the
K/V (model, dtype, cache layout) and the request's cache salt; a hit also compares the stored tokens.
The crafted-collision tests make every key collide (what the unkeyed 64-bit ``hash()`` allowed for a
patient attacker) and check that request B still gets its own stream and no cached tokens.
"""

from __future__ import annotations

import pytest
import torch

import kvcore.scheduling.prefix_index as prefix_index
from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.conformance.models import get_model
from kvcore.errors import InvalidRequestError
from kvcore.scheduling.block_manager import BlockManager
from kvcore.scheduling.block_pool import block_key, root_key

BS = 4
A = list(range(100, 100 + 3 * BS)) + [7]  # 3 full blocks and a last token
B = list(range(200, 200 + 3 * BS)) + [7]  # same length, every block different


def computed(m: BlockManager, seq_id: int, token_ids: list[int], salt: str | None = None) -> int:
    cached = m.add_sequence(seq_id, token_ids, salt)
    m.reserve([seq_id], [len(token_ids) - cached])
    m.commit(seq_id, token_ids)
    return cached


def colliding(monkeypatch) -> None:
    """Every block key the same: the worst a broken or attacked hash could do."""
    monkeypatch.setattr(prefix_index, "block_key", lambda parent, tokens: b"\0" * 32)


def test_keys_are_sha256_over_parent_and_token_bytes():
    root = root_key("m", None)
    assert len(root) == 32 and root != root_key("m", "tenant") != root_key("n", None)
    assert root_key("ab", "c") != root_key("a", "bc")  # the namespace is length-prefixed
    key = block_key(root, [1, 2, 3, 4])
    assert len(key) == 32 and key == block_key(root, (1, 2, 3, 4))
    assert key != block_key(root, [1, 2, 3, 5]) and key != block_key(root_key("m", "x"), [1, 2, 3, 4])
    # tokens are 64-bit: ids that agree in their low bytes still differ
    assert block_key(root, [1]) != block_key(root, [1 + (1 << 32)])


def test_a_colliding_key_is_no_hit_when_the_tokens_differ(monkeypatch):
    colliding(monkeypatch)
    m = BlockManager(16, BS, 64, enable_prefix_caching=True)
    assert computed(m, 0, A) == 0
    assert m.add_sequence(1, B) == 0 and m.block_table(1) == []
    assert m.add_sequence(2, A) == BS  # the same tokens still hit (one key: only A's first block is stored)


def test_cache_salt_separates_tenants():
    m = BlockManager(16, BS, 64, enable_prefix_caching=True)
    computed(m, 0, A, "alice")
    assert m.add_sequence(1, A, "bob") == 0
    assert m.add_sequence(2, A) == 0  # no salt is not any salt
    assert m.add_sequence(3, A, "alice") == 3 * BS
    m.reserve([3], [1])
    m.fork_sequence(3, 4)  # a fork keeps its parent's salt for its own commits
    m.reserve([4], [3])
    m.commit(4, A + [9, 9, 9])  # its fourth block is full now
    assert m.add_sequence(5, A + [9, 9, 9, 1], "alice") == 4 * BS
    assert m.add_sequence(6, A + [9, 9, 9, 1], "bob") == 0


def test_a_different_namespace_shares_nothing():
    one = BlockManager(16, BS, 64, enable_prefix_caching=True, namespace="model-a|float32")
    computed(one, 0, A)
    key = one._index._key_of[one.block_table(0)[0]][1]
    other = BlockManager(16, BS, 64, enable_prefix_caching=True, namespace="model-a|bfloat16")
    computed(other, 0, A)
    assert other._index._key_of[other.block_table(0)[0]][1] != key


# -- through the engine --------------------------------------------------------------------------------

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return get_model("tiny", torch.float32, "cpu").model


def test_crafted_collision_b_gets_its_own_stream_and_no_cached_tokens(tiny, monkeypatch):
    a = [(7 * i) % 500 + 3 for i in range(40)]
    b = [(11 * i) % 500 + 5 for i in range(40)]
    config = dict(backend="paged", max_model_len=128)
    expected_b = Engine(tiny, None, EngineConfig(**config)).generate([b], GREEDY)[0].token_ids
    colliding(monkeypatch)
    engine = Engine(tiny, None, EngineConfig(**config, enable_prefix_caching=True))
    engine.generate([a], GREEDY)
    got = engine.generate([b], GREEDY)[0]
    assert got.metrics.num_cached_tokens == 0
    assert got.token_ids == expected_b
    # the same tokens still hit: one key holds one block, A's first
    assert engine.generate([a], GREEDY)[0].metrics.num_cached_tokens == 16


def test_engine_cache_salt(tiny):
    prompt = [(7 * i) % 500 + 3 for i in range(40)]
    engine = Engine(tiny, None, EngineConfig(backend="paged", max_model_len=128, enable_prefix_caching=True))
    salted = SamplingParams(max_new_tokens=4, ignore_eos=True, cache_salt="alice")
    first = engine.generate([prompt], salted)[0]
    other = engine.generate([prompt], SamplingParams(max_new_tokens=4, ignore_eos=True, cache_salt="bob"))[0]
    again = engine.generate([prompt], salted)[0]
    assert (first.metrics.num_cached_tokens, other.metrics.num_cached_tokens) == (0, 0)
    assert again.metrics.num_cached_tokens == 32
    assert first.token_ids == other.token_ids == again.token_ids


@pytest.mark.parametrize("salt", ["", 5, b"x"])
def test_cache_salt_must_be_a_non_empty_string(salt):
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        SamplingParams(cache_salt=salt)


@pytest.mark.parametrize("ids", [5, "5", [1, "2"], [True], None])
def test_stop_token_ids_must_be_integers(ids):
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=ids)
