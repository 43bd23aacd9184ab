"""The driver: prefill/decode, batching, stopping, streaming, metrics, isolation, backend pairing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import make_plugin, make_random_model

from kvcore import CacheSpec, Engine, EngineConfig, FinishReason, SamplingParams
from kvcore.backends.contiguous import ContiguousKVCache
from kvcore.backends.paged import PagedKVCache
from kvcore.errors import ConfigError, ContextLengthError, InvalidRequestError
from kvcore.execution.runner import last_token_logits
from kvcore.plugins.registry import PluginRegistry
from kvcore.scheduling.kv_manager import KVCacheManager
from kvcore.scheduling.request import EngineGauges

PROMPTS = [[1, 5, 9, 13, 17], [7, 8], list(range(10, 50)), [9]]
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def run(model, backend, prompts=PROMPTS, params=GREEDY, **cfg):
    engine = Engine(model, None, EngineConfig(backend=backend, max_model_len=128, **cfg))
    return [r.token_ids for r in engine.generate(prompts, params)]


@pytest.mark.parametrize("backend", ["sdpa", "paged"])
def test_backends_match_reference_greedy(random_model, backend):
    assert run(random_model, backend) == run(random_model, "naive")


def test_batch_equals_each_prompt_alone(random_model):
    batched = run(random_model, "sdpa")
    alone = [run(random_model, "sdpa", [p])[0] for p in PROMPTS]
    assert batched == alone


def test_streams_are_not_degenerate(random_model):
    # guards the tests above from passing on a model that repeats one token
    streams = run(random_model, "naive")
    assert all(len(set(s)) > 3 for s in streams)


@pytest.mark.parametrize(
    "backend, cache_cls, cache_options, tol",
    [
        ("naive", ContiguousKVCache, {}, 1e-5),
        # SDPA's fused kernels sum in a different order for one query row than for a whole prompt
        ("paged", PagedKVCache, {"block_size": 4}, 1e-4),
    ],
    ids=["naive-contiguous", "paged-4"],
)
def test_cached_decode_equals_full_recompute(backend, cache_cls, cache_options, tol):
    """The KV cache's central claim, at every step: cached decode logits == recomputation from scratch
    (for the paged cache, with decode steps crossing block boundaries). A model of its own: what other tests
    do to the session's shared model (prepacked weights, layouts) must not move the rounding compared here."""
    from kvcore.plugins.registry import get_registry

    model, backend = make_random_model(), get_registry().create(backend)
    c = model.config
    scale = model.attention_scale
    assert scale == c.head_dim**-0.5
    spec = CacheSpec(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, torch.float32, torch.device("cpu"), 1, 128)
    kv = KVCacheManager(cache_cls(spec, **cache_options))
    kv.add_sequence(0)
    ids = [3, 14, 15, 92, 65]
    meta = kv.prepare([0], [len(ids)], scale)
    logits = last_token_logits(model, backend, kv.cache, meta, ids)  # [1, V]
    for _ in range(8):
        ids.append(int(logits.argmax()))
        fresh = KVCacheManager(cache_cls(spec, **cache_options))
        fresh.add_sequence(0)
        full = last_token_logits(model, backend, fresh.cache, fresh.prepare([0], [len(ids)], scale), ids)
        meta = kv.prepare([0], [1], scale)
        logits = last_token_logits(model, backend, kv.cache, meta, ids[-1:])
        torch.testing.assert_close(logits, full, rtol=tol, atol=tol)
    assert kv.seq_len(0) == len(ids)


@pytest.mark.parametrize(
    "cfg",
    [dict(backend="sdpa"), dict(backend="paged", block_size=4), dict(kv_cache="int8", block_size=4)],
    ids=["sdpa-contiguous", "paged", "int8"],
)
def test_cache_is_written_in_place_never_reallocated(random_model, cfg):
    engine = Engine(random_model, None, EngineConfig(max_model_len=64, **cfg))
    assert engine.cache is engine.kv.cache
    storage = {name: t for name, t in vars(engine.cache).items() if isinstance(t, torch.Tensor)}
    assert storage  # k/v, k_pool/v_pool, and the int8 cache's scales
    ptrs = {name: t.data_ptr() for name, t in storage.items()}
    rid = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=10, ignore_eos=True))
    seen_lengths = []
    while engine.has_unfinished():
        engine.step()
        if engine.gauges().num_running:
            seen_lengths.append(engine.kv.seq_len(engine._requests[rid].seq_id))
        for name, t in storage.items():
            assert getattr(engine.cache, name) is t and t.data_ptr() == ptrs[name], name
    assert seen_lengths == list(range(3, 12))  # prompt, then one row per decode step


def test_stop_conditions(random_model):
    engine = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=64))
    free_run = engine.generate([[1, 5, 9]], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    assert free_run.finish_reason is FinishReason.LENGTH and len(free_run.token_ids) == 10
    stop_at = free_run.token_ids[4]
    first = free_run.token_ids.index(stop_at)
    stopped = engine.generate([[1, 5, 9]], SamplingParams(max_new_tokens=10, stop_token_ids=(stop_at,)))[0]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == free_run.token_ids[: first + 1]

    # the model's EOS id (2) ends generation unless ignore_eos
    engine.eos_token_ids = frozenset({stop_at})
    eos = engine.generate([[1, 5, 9]], SamplingParams(max_new_tokens=10))[0]
    assert eos.finish_reason is FinishReason.EOS and eos.token_ids[-1] == stop_at
    # ignore_eos suppresses EOS: exactly max_new_tokens tokens, none of them EOS, same prefix before it
    ignored = engine.generate([[1, 5, 9]], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    assert len(ignored.token_ids) == 10 and stop_at not in ignored.token_ids
    assert ignored.token_ids[:first] == free_run.token_ids[:first]


def test_context_limit_is_checked_up_front(random_model):
    engine = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=32))
    with pytest.raises(ContextLengthError, match="exceeds the context limit of 32"):
        engine.add_request(list(range(1, 30)), SamplingParams(max_new_tokens=5))
    assert not engine.has_unfinished()
    # exactly filling the window is fine
    res = engine.generate([list(range(1, 28))], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert len(res.token_ids) == 5


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], SamplingParams(), "empty"),
        ([1, 2, 100000], SamplingParams(), "outside the vocabulary"),
    ],
)
def test_invalid_requests_leave_engine_untouched(random_model, prompt, params, match):
    engine = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=64))
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished() and engine.kv.blocks.num_tokens_in_use == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_abort_isolates_other_requests(random_model):
    alone = run(random_model, "sdpa", [PROMPTS[0]])[0]
    engine = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=128))
    keep = engine.add_request(PROMPTS[0], GREEDY)
    victim = engine.add_request(PROMPTS[2], GREEDY)
    engine.step()
    engine.step()
    engine.abort(victim)
    assert engine.result(victim).finish_reason is FinishReason.ABORT
    while engine.has_unfinished():
        engine.step()
    assert engine.result(keep).token_ids == alone
    assert engine.kv.blocks.num_tokens_in_use == 0 and engine.kv.can_add_sequence()
    assert engine.kv.blocks.num_free_blocks == engine.kv.blocks.num_blocks


def test_continuous_batching_join_midway(random_model):
    alone = [run(random_model, "sdpa", [p])[0] for p in PROMPTS[:2]]
    engine = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=128))
    first = engine.add_request(PROMPTS[0], GREEDY)
    for _ in range(4):
        engine.step()
    second = engine.add_request(PROMPTS[1], GREEDY)  # joins a running batch
    while engine.has_unfinished():
        engine.step()
    assert [engine.result(first).token_ids, engine.result(second).token_ids] == alone


def test_more_requests_than_slots_queue_up(random_model):
    expected = run(random_model, "sdpa")
    assert run(random_model, "sdpa", max_num_seqs=2) == expected


def test_seeded_sampling_is_reproducible_and_backend_independent(random_model):
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
    a = run(random_model, "naive", [[1, 2, 3]], params)
    assert a == run(random_model, "naive", [[1, 2, 3]], params)
    assert a == run(random_model, "sdpa", [[1, 2, 3]], params)
    other = SamplingParams(max_new_tokens=12, temperature=0.9, seed=8, ignore_eos=True)
    assert a != run(random_model, "naive", [[1, 2, 3]], other)


def test_metrics(random_model):
    engine = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=64))
    res = engine.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    m = res.metrics
    assert m.num_prompt_tokens == 4 and m.num_generated_tokens == 6
    assert m.ttft_s > 0 and m.tpot_s > 0 and m.tokens_per_s == pytest.approx(1 / m.tpot_s)
    c = random_model.config
    # KV bytes = 2 × layers × kv_heads × head_dim × seq_len × bytes; the last token is sampled, never cached
    assert m.kv_bytes == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * (4 + 6 - 1) * 4


def test_gauges_follow_a_request_from_queue_to_release(random_model):
    engine = Engine(random_model, None, EngineConfig(backend="paged", max_model_len=64, max_num_seqs=1,
                                                     kv_cache_options={"paged": {"block_size": 4}}))
    idle = engine.gauges()
    assert idle == EngineGauges(0, 0, 0, idle.num_kv_blocks, idle.num_kv_blocks) and idle.num_kv_blocks > 0
    first = engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=2, ignore_eos=True))
    engine.add_request([6, 7], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert engine.gauges() == dataclasses.replace(idle, num_waiting=2, num_requests_held=2)
    engine.step()  # one slot: the first runs, holding two blocks of 4 for its 5 prompt tokens
    assert engine.gauges() == dataclasses.replace(idle, num_running=1, num_waiting=1, num_requests_held=2,
                                                  num_kv_blocks_free=idle.num_kv_blocks - 2)
    while engine.has_unfinished():
        engine.step()
    assert engine.gauges() == dataclasses.replace(idle, num_requests_held=2)  # finished, not yet released
    engine.release(first)
    assert engine.gauges().num_requests_held == 1


def test_per_phase_backends_share_one_cache(random_model):
    expected = run(random_model, "naive")
    engine = Engine(random_model, None, EngineConfig(prefill_backend="naive", decode_backend="sdpa", max_model_len=128))
    assert (engine.prefill_backend.name, engine.decode_backend.name) == ("naive", "sdpa")
    assert engine.cache.layout == "contiguous"  # one cache both phases read
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == expected


def test_incompatible_phase_pair_is_refused(random_model):
    with pytest.raises(ConfigError, match="share no KV-cache layout"):
        Engine(random_model, None, EngineConfig(prefill_backend="naive", decode_backend="paged"))


def test_auto_backend_picks_an_available_one(random_model):
    engine = Engine(random_model, None, EngineConfig())
    assert engine.prefill_backend.availability() is None


def test_reduced_precision_runs(random_model):
    model = make_random_model(dtype=torch.bfloat16)
    engine = Engine(model, None, EngineConfig(backend="sdpa", dtype="bfloat16", max_model_len=64))
    res = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert len(res.token_ids) == 5 and engine.cache.k.dtype == torch.bfloat16
    assert engine.kv.kv_bytes_in_use() == 0


def test_unknown_dtype():
    with pytest.raises(ConfigError, match="unknown dtype 'float8'"):
        EngineConfig(dtype="float8")


@pytest.mark.parametrize("num_blocks", [14, 20, 30])
def test_tight_paged_pool_preempts_without_changing_streams(random_model, num_blocks):
    """Requests that fit alone but not together queue or get preempted; no stream changes."""
    expected = run(random_model, "naive")
    engine = Engine(random_model, None, EngineConfig(backend="paged", block_size=4, num_blocks=num_blocks,
                                                     max_model_len=128))
    results = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == expected
    assert engine.kv.blocks.num_free_blocks == num_blocks  # every block back in the pool
    assert engine.kv.blocks.num_tokens_in_use == 0
    if num_blocks == 14:  # the four requests need 24 blocks at their peak
        assert sum(r.metrics.num_preemptions for r in results) > 0


def test_request_larger_than_whole_pool_fails_alone(random_model):
    engine = Engine(random_model, None, EngineConfig(backend="paged", block_size=4, num_blocks=4, max_model_len=128))
    results = engine.generate([list(range(1, 40)), [1, 2]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert results[0].finish_reason is FinishReason.ERROR and "more than the whole cache holds" in str(results[0].error)
    alone = run(random_model, "naive", [[1, 2]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
    assert results[1].token_ids == alone
    assert engine.kv.blocks.num_free_blocks == 4


def test_backend_failure_ends_only_that_batch(random_model):
    from kvcore.backends.sdpa import SDPABackend
    from kvcore.errors import BackendError

    class Fragile(SDPABackend):
        name = "fragile"

        def forward(self, layer_idx, q, k, v, cache, plan):
            if plan.meta.max_query_len == 7:
                raise RuntimeError("kernel exploded")
            return super().forward(layer_idx, q, k, v, cache, plan)

    registry = PluginRegistry(load_entrypoints=False)
    registry.register_plugin(make_plugin(backends=[Fragile]), name="fragile-plugin")
    alone = run(random_model, "sdpa", [PROMPTS[0]])[0]
    engine = Engine(random_model, None, EngineConfig(backend="fragile", max_model_len=128), registry=registry)
    keep = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    engine.step()
    doomed = engine.add_request(list(range(20, 27)), GREEDY)  # its 7-token prefill raises
    while engine.has_unfinished():
        engine.step()
    failed = engine.result(doomed)
    assert failed.finish_reason is FinishReason.ERROR and isinstance(failed.error, BackendError)
    assert "kernel exploded" in str(failed.error)
    assert engine.result(keep).token_ids == alone
    assert engine.kv.blocks.num_tokens_in_use == 0
