"""Chunked prefill: same greedy streams as whole-prompt prefill on every backend and under preemption,
the token budget, decodes every step while a long prompt is admitted, which backend runs a mixed step;
prefix sharing counted in the engine's stats."""

from __future__ import annotations

import pytest
from helpers import make_random_model

from kvcore import Engine, EngineConfig, SamplingParams

GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
PROMPTS = [[1, 5, 9, 13, 17], list(range(10, 110)), [7, 8], list(range(3, 60)), [9]]


@pytest.fixture(scope="module")
def model():
    return make_random_model(max_positions=2048)


def staggered(engine: Engine, prompts=PROMPTS, params=GREEDY, every: int = 2) -> list[list[int]]:
    """Add one prompt every ``every`` steps (so prompts join running batches), run to the end."""
    ids, pending = [], list(prompts)
    while pending or engine.has_unfinished():
        if pending and (not ids or engine.stats.num_steps % every == 0):
            ids.append(engine.add_request(pending.pop(0), params))
        engine.step()
    return [engine.release(r).token_ids for r in ids]


@pytest.mark.parametrize("backend", ["naive", "sdpa", "paged"])
def test_greedy_streams_are_identical_with_and_without_chunking(model, backend):
    def run(chunked: bool, budget: int) -> list[list[int]]:
        cfg = EngineConfig(backend=backend, max_model_len=256, enable_chunked_prefill=chunked,
                           max_num_batched_tokens=budget)
        return staggered(Engine(model, None, cfg))

    whole = run(False, 8192)
    assert run(True, 8192) == whole
    assert run(True, 16) == whole  # every long prompt split into many chunks


@pytest.mark.parametrize("num_blocks", [15, 24])
def test_chunked_prefill_under_preemption_keeps_streams(model, num_blocks):
    want = staggered(Engine(model, None, EngineConfig(backend="naive", max_model_len=256)))
    cfg = EngineConfig(backend="paged", block_size=8, num_blocks=num_blocks, max_model_len=256,
                       max_num_batched_tokens=24)
    engine = Engine(model, None, cfg)
    assert staggered(engine) == want
    assert engine.kv.blocks.num_free_blocks == num_blocks
    if num_blocks == 15:
        assert engine.stats.num_preemptions > 0


def test_decodes_run_every_step_while_a_long_prompt_is_chunked(model):
    budget = 32
    engine = Engine(model, None, EngineConfig(backend="sdpa", max_model_len=1024, max_num_batched_tokens=budget))
    sizes = []
    prepare = engine.kv.prepare
    engine.kv.prepare = lambda ids, lens, *rest: sizes.append(list(lens)) or prepare(ids, lens, *rest)
    short = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=40, ignore_eos=True))
    engine.step()
    long_prompt = [(i * 7) % 290 + 5 for i in range(600)]
    long_id = engine.add_request(long_prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))
    first_long_token, step = None, 1
    while engine.has_unfinished():
        events = engine.step()
        step += 1
        got = {e.request_id for e in events}
        if first_long_token is None:
            assert short in got or engine.result(short).finish_reason is not None  # a token every step
            if long_id in got:
                first_long_token = step
    assert all(sum(s) <= budget for s in sizes)
    assert first_long_token >= 1 + 600 // (budget - 1)  # no token before its last chunk
    assert engine.stats.num_prefill_tokens == 3 + 600


def test_a_mixed_step_runs_on_the_prefill_backend(model):
    engine = Engine(model, None, EngineConfig(prefill_backend="naive", decode_backend="sdpa", max_model_len=256,
                                              max_num_batched_tokens=16))
    seen = {"naive": [], "sdpa": []}
    for backend in (engine.prefill_backend, engine.decode_backend):
        plan = backend.plan
        backend.plan = lambda meta, cache, plan=plan, name=backend.name: seen[name].append(meta) or plan(meta, cache)
    want = staggered(Engine(model, None, EngineConfig(backend="naive", max_model_len=256)))
    assert staggered(engine) == want
    assert all(max(m.query_lens) == 1 and min(m.context_lens) > 0 for m in seen["sdpa"])
    assert any(max(m.query_lens) > 1 and 1 in m.query_lens for m in seen["naive"])  # mixed steps happened


@pytest.mark.parametrize("chunked", [False, True])
def test_shared_system_prompt_is_computed_once(model, chunked):
    system = [(i * 13) % 280 + 3 for i in range(1000)]  # 1,000 tokens
    prompts = [system + [290 - i, 7, 8, 9, 10, 11, 12, 13] for i in range(8)]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)

    def run(sharing: bool) -> tuple[list[list[int]], Engine]:
        cfg = EngineConfig(backend="paged", max_model_len=1100, enable_prefix_caching=sharing,
                           enable_chunked_prefill=chunked, num_blocks=600)
        engine = Engine(model, None, cfg)
        return [r.token_ids for r in engine.generate(prompts, params)], engine

    plain, e0 = run(False)
    shared, e1 = run(True)
    assert shared == plain
    assert e0.stats.num_prefill_tokens == 8 * 1008 and e0.stats.num_cached_tokens == 0
    assert e1.stats.num_prefill_tokens * 7 <= e0.stats.num_prefill_tokens
    assert e1.stats.num_cached_tokens == 7 * 992  # 62 full blocks of 16 each
    results = e1.generate(prompts[:1], params)  # a later request hits the cache too
    assert results[0].metrics.num_cached_tokens == 992
