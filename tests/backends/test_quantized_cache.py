"""The ``int8`` KV cache: rounding bound, bytes, copy-on-write of scales, capacity and greedy streams.

Each stored row (one token of one KV head) is ``round(x / s)`` with ``s = max|x| / 127``, so an element
comes back within ``s / 2 = max|x| / 254``. The cache serves the ``paged`` backend through the "paged"
layout; streams are compared with the full-precision ``paged`` cache as llm-eval harnesses compare
precisions: equal tokens, or at the first divergence a near-tie of the reference, and no further.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.backends.contiguous import ContiguousKVCache
from kvcore.backends.paged import PagedBackend, PagedKVCache
from kvcore.backends.quantized import Int8KVCache
from kvcore.conformance.models import get_model
from kvcore.errors import ConfigError
from kvcore.interfaces.kv_cache import CacheSpec
from kvcore.plugins.registry import KV_CACHE, get_registry
from kvcore.sampling.sampler import DefaultSampler
from kvcore.scheduling.kv_manager import KVCacheManager

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread is ~2x faster than two on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_spec(*, layers=1, kv_heads=2, head_dim=16, dtype=torch.float32, block_size=4, num_blocks=16,
              max_seq_len=64) -> CacheSpec:
    return CacheSpec(
        num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=CPU, max_num_seqs=4,
        max_seq_len=max_seq_len, block_size=block_size, num_blocks=num_blocks,
    )


def dequantize(x: torch.Tensor) -> torch.Tensor:
    """What the cache gives back for ``x`` (float32): the int8 values times their row's scale."""
    q, scale = Int8KVCache.quantize(x)
    return q.float() * scale[..., None]


def rows_with_varied_scales(shape, seed=0) -> torch.Tensor:
    """Rows ``[..., D]`` whose magnitudes span 1e-3 .. 1e3, with an all-zero row and an outlier row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[0])[(...,) + (None,) * (len(shape) - 1)]
    x[0] = 0.0
    x[1, ..., 0] = 500.0  # one element dominates its row's scale
    return x


# -- the rounding ------------------------------------------------------------------------------------------


def test_quantize_round_trip_within_half_a_step():
    x = rows_with_varied_scales((64, 3, 64))
    q, scale = Int8KVCache.quantize(x)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    assert q.abs().max() <= 127  # symmetric: -128 is never used
    amax = x.abs().amax(-1)
    err = (q.float() * scale[..., None] - x).abs().amax(-1)
    assert torch.all(err <= amax / 254 * (1 + 1e-6))
    # the declared rounding the conformance suite derives its tolerances from is this bound
    assert Int8KVCache.capabilities.unit_roundoff == pytest.approx(1 / 254)
    assert torch.equal(dequantize(x)[0], torch.zeros_like(x[0]))  # a zero row stays exact
    assert torch.equal(q.abs().amax(-1)[1:], torch.full_like(amax[1:], 127, dtype=torch.int8))  # full range used


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_then_read_returns_the_model_dtype_within_the_bound(dtype):
    spec = make_spec(dtype=dtype, layers=2)
    kv = KVCacheManager(Int8KVCache(spec))
    kv.add_sequence(0)
    kv.add_sequence(1)
    meta = kv.prepare([0, 1], [5, 7], 1.0)
    k = rows_with_varied_scales((12, 2, 16), seed=1).clamp(-6e4, 6e4).to(dtype)
    v = -rows_with_varied_scales((12, 2, 16), seed=2).clamp(-6e4, 6e4).to(dtype)
    for layer in range(2):
        kv.cache.write(layer, k, v * (layer + 1), meta)
    for layer in range(2):
        for s, rows in ((0, slice(0, 5)), (1, slice(5, 12))):
            got_k, got_v = kv.read(layer, s)
            assert got_k.dtype == got_v.dtype == dtype and got_k.shape == (rows.stop - rows.start, 2, 16)
            for got, want in ((got_k, k[rows]), (got_v, v[rows] * (layer + 1))):
                # exactly the dequantized rows in the model dtype, which are within max|x| / 254 in float32
                assert torch.equal(got, dequantize(want).to(dtype))
                bound = want.float().abs().amax(-1, keepdim=True) / 254
                assert torch.all((dequantize(want) - want.float()).abs() <= bound * (1 + 1e-6))


# -- bytes ------------------------------------------------------------------------------------------------


def test_bytes_per_token_smollm2_shape_at_least_halved():
    spec = CacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32, device=CPU, max_num_seqs=1,
                     max_seq_len=64, block_size=16, num_blocks=2)
    full = ContiguousKVCache.token_bytes(spec)
    assert full == 2 * 30 * 3 * 64 * 4 == PagedKVCache.token_bytes(spec)
    int8 = Int8KVCache.token_bytes(spec)
    assert int8 == 2 * 30 * 3 * (64 + 4)  # int8 values + one float32 scale per token and KV head
    assert int8 / full == (64 + 4) / (4 * 64)
    assert int8 / full <= 1 / 2
    # and what is allocated is what capacity planning divides by
    cache = Int8KVCache(spec)
    assert cache.bytes_per_token == int8
    assert cache.kv_bytes_allocated == int8 * cache.num_blocks * cache.block_size
    assert cache.k_pool.dtype == torch.int8 and cache.k_scale.dtype == torch.float32


# -- copy-on-write -------------------------------------------------------------------------------------------


def test_copy_on_write_copies_the_scales_too():
    kv = KVCacheManager(Int8KVCache(make_spec(layers=2, block_size=4)))
    kv.add_sequence(0)
    meta = kv.prepare([0], [6], 1.0)  # one full block, one with 2 tokens
    prefix = [rows_with_varied_scales((6, 2, 16), seed=s) for s in range(4)]  # k, v of two layers
    for layer in range(2):
        kv.cache.write(layer, prefix[2 * layer], prefix[2 * layer + 1], meta)
    kv.fork_sequence(0, 1)

    meta = kv.prepare([0, 1], [1, 1], 1.0)  # both write into the shared, partly filled block: one copy
    assert kv.blocks.block_table(0)[1] != kv.blocks.block_table(1)[1]
    new = {s: [torch.full((1, 2, 16), 3.0 * (s + 1) + i) for i in range(4)] for s in (0, 1)}
    for layer in range(2):
        k = torch.cat([new[0][2 * layer], new[1][2 * layer]])
        v = torch.cat([new[0][2 * layer + 1], new[1][2 * layer + 1]])
        kv.cache.write(layer, k, v, meta)
    for s in (0, 1):
        for layer in range(2):
            got_k, got_v = kv.read(layer, s)
            for got, old, added in ((got_k, prefix[2 * layer], new[s][2 * layer]),
                                    (got_v, prefix[2 * layer + 1], new[s][2 * layer + 1])):
                assert torch.equal(got, dequantize(torch.cat([old, added])))


def test_paged_backend_on_int8_equals_attention_over_the_rounded_kv():
    """The only difference int8 makes to attention is the rounding of K and V."""
    spec = make_spec(layers=2, kv_heads=2, head_dim=32, block_size=4, num_blocks=24)
    backend = PagedBackend()
    int8, ref = KVCacheManager(Int8KVCache(spec)), KVCacheManager(PagedKVCache(spec))
    gen = torch.Generator().manual_seed(3)
    for kv in (int8, ref):
        kv.add_sequence(0)
        kv.add_sequence(1)
    for seq_ids, lens in (([0, 1], [9, 5]), ([0, 1], [1, 1]), ([1, 0], [3, 1])):
        m8, mr = int8.prepare(seq_ids, lens, 32**-0.5), ref.prepare(seq_ids, lens, 32**-0.5)
        p8, pr = backend.plan(m8, int8.cache), backend.plan(mr, ref.cache)
        for layer in range(2):
            q = torch.randn(sum(lens), 8, 32, generator=gen)
            k, v = torch.randn(sum(lens), 2, 32, generator=gen), torch.randn(sum(lens), 2, 32, generator=gen)
            out = backend.forward(layer, q, k, v, int8.cache, p8)
            want = backend.forward(layer, q, dequantize(k), dequantize(v), ref.cache, pr)
            torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


# -- the engine ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return get_model("tiny", torch.float32, "cpu")


def test_registered_and_refused_by_a_contiguous_backend(tiny):
    entry = get_registry().get("int8", KV_CACHE)
    assert entry.cls is Int8KVCache and Int8KVCache.layout == "paged"
    assert Int8KVCache.capabilities.precision and Int8KVCache.capabilities.unit_roundoff == 1 / 254
    with pytest.raises(ConfigError, match=r"KV cache 'int8' has layout 'paged'.*'sdpa'"):
        Engine(tiny.model, None, EngineConfig(backend="sdpa", kv_cache="int8", max_model_len=64))
    auto = Engine(tiny.model, None, EngineConfig(kv_cache="int8", max_model_len=64))
    assert isinstance(auto.cache, Int8KVCache) and "paged" in auto.decode_backend.capabilities.kv_layouts


def test_same_budget_holds_at_least_twice_the_blocks_and_requests(tiny):
    c = tiny.config
    budget = 8 * 16 * (2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4)  # 8 fp32 blocks of 16
    engines = {}
    for name in ("paged", "int8"):
        config = EngineConfig(backend="paged", kv_cache=name, kv_cache_bytes=budget, max_num_seqs=64,
                              max_model_len=64)
        engines[name] = Engine(tiny.model, None, config)
    assert engines["paged"].kv.blocks.num_blocks == 8
    assert engines["int8"].kv.blocks.num_blocks >= 2 * engines["paged"].kv.blocks.num_blocks
    assert engines["int8"].cache.kv_bytes_allocated <= budget

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, c.vocab_size, (20,), generator=gen).tolist() for _ in range(24)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)  # 26 tokens: 2 blocks each, no preemption
    most = {}
    for name, engine in engines.items():
        for p in prompts:
            engine.add_request(p, params)
        most[name] = 0
        while engine.has_unfinished():
            engine.step()
            most[name] = max(most[name], engine.gauges().num_running)
    assert most["paged"] == 4
    assert most["int8"] >= 2 * most["paged"]


class RecordingSampler(DefaultSampler):
    """Greedy picks, keeping every row's logits per request (the evidence for near-tie checks)."""

    def __init__(self):
        super().__init__()
        self.logits: dict[str, list[torch.Tensor]] = defaultdict(list)

    def sample(self, logits, rows):
        for row, rec in zip(rows, logits):
            self.logits[row.request_id].append(rec.detach().clone())
        return super().sample(logits, rows)


def first_divergence_is_a_near_tie(ref_tokens, ref_logits, tokens, logits, max_gap=0.05) -> tuple[int, str]:
    """``(number of equal leading tokens, why it stopped)``. Raises AssertionError unless the streams are
    equal or, at the first differing step, the two picks are the reference's top two with a logit gap
    under ``max_gap`` and also the test's own top two (so neither side picked something far down)."""
    for i, (a, b) in enumerate(zip(ref_tokens, tokens)):
        if a == b:
            continue
        ref_top, test_top = ref_logits[i].topk(2), logits[i].topk(2)
        gap = float(ref_top.values[0] - ref_top.values[1])
        assert set(ref_top.indices.tolist()) == {a, b} == set(test_top.indices.tolist()), (
            f"step {i}: reference picked {a}, int8 picked {b}; reference top-2 {ref_top.indices.tolist()}, "
            f"int8 top-2 {test_top.indices.tolist()}")
        assert gap < max_gap, f"step {i}: streams diverge ({a} vs {b}) where the reference's top-2 gap is {gap:.4f}"
        return i, f"near-tie at step {i} (gap {gap:.4f})"
    assert len(ref_tokens) == len(tokens)
    return len(tokens), "equal"


def test_the_near_tie_helper_is_strict():
    logits = [torch.tensor([0.0, 5.0, 4.99, 1.0]), torch.tensor([0.0, 5.0, 3.0, 1.0])]
    assert first_divergence_is_a_near_tie([1, 1], logits, [1, 1], logits) == (2, "equal")
    assert first_divergence_is_a_near_tie([1, 1], logits, [2, 1], logits)[0] == 0  # gap 0.01: a near-tie
    with pytest.raises(AssertionError, match="gap is 2.0"):
        first_divergence_is_a_near_tie([1, 1], logits, [1, 2], logits[:1] + [torch.tensor([0.0, 3.0, 5.0, 1.0])])
    with pytest.raises(AssertionError, match="top-2"):
        first_divergence_is_a_near_tie([1, 1], logits, [3, 1], logits)  # not among the reference's top two


def test_int8_greedy_streams_equal_full_precision_or_diverge_at_a_near_tie(tiny):
    gen = torch.Generator().manual_seed(11)
    prompts = tiny.prompts + [torch.randint(3, tiny.config.vocab_size, (n,), generator=gen).tolist()
                              for n in (1, 9, 48)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    runs = {}
    for name in ("paged", "int8"):
        sampler = RecordingSampler()
        engine = Engine(tiny.model, None, EngineConfig(backend="paged", kv_cache=name, max_model_len=128),
                        sampler=sampler)
        results = engine.generate(prompts, params)
        runs[name] = [(r.token_ids, sampler.logits[r.request_id]) for r in results]
    outcomes = [first_divergence_is_a_near_tie(*runs["paged"][i], *runs["int8"][i]) for i in range(len(prompts))]
    # keep it honest: a near-tie ends a comparison early, so most tokens must still have been compared
    # (today: 5 streams equal, one diverges at step 18 of 24 where the reference's gap is 0.003)
    assert sum(n for n, _ in outcomes) >= 0.8 * len(prompts) * params.max_new_tokens, outcomes
    assert sum(why == "equal" for _, why in outcomes) >= len(prompts) // 2, outcomes
    # and the logits themselves are close (the rounding is small), not merely their argmax
    for (_, ref_logits), (_, logits) in zip(runs["paged"], runs["int8"]):
        torch.testing.assert_close(logits[0], ref_logits[0], atol=0.1, rtol=0)
