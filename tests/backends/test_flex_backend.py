"""The ``flex`` backend (FlexAttention) against the naive oracle: every built-in variant, a registered variant written
here (ALiBi as a ``score_mod``, a local band as a ``mask_mod``), GQA, prefill, decode and chunked prefill, on the
contiguous and the paged cache; fp32 greedy streams of a tiny model equal to naive's. These run FlexAttention eagerly
(``compile = false``); one test compiles it, and shows that the key buckets keep decode from recompiling per length.
Where inductor caches compiled kernels follows kvcore's cache rules."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from golden import FIRST_TOKENS, check_against_golden, load_golden
from helpers import make_random_gemma3, make_random_model
from test_paged import _one_thread, make_spec, shuffle_pool  # noqa: F401 (autouse: tiny tensors, one thread)

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.backends.contiguous import ContiguousKVCache
from kvcore.backends.flex import RECOMPILE_LIMIT, FlexBackend
from kvcore.backends.flex_mods import block_mask, bucket, flex_reason, mask_mod, use_kvcore_inductor_cache
from kvcore.backends.naive import NaiveBackend
from kvcore.backends.paged import PagedKVCache
from kvcore.errors import CacheTrustError, ConfigError
from kvcore.interfaces.attention import explicit_attention
from kvcore.interfaces.layer_attention import LayerAttention
from kvcore.interfaces.variants import BoundVariant
from kvcore.plugins.registry import BACKEND, get_registry
from kvcore.scheduling.kv_manager import KVCacheManager


def _has_flex() -> bool:
    try:
        from torch.nn.attention.flex_attention import AuxRequest  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _has_flex(), reason="torch has no FlexAttention")
HEADS, KV_HEADS, D = 4, 2, 16
SCALE = D**-0.5


def alibi(num_heads: int) -> BoundVariant:
    """ALiBi as a registered variant would bind it: a per-head linear penalty on the distance to the key."""
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / num_heads) for h in range(num_heads)])
    return BoundVariant("alibi", score_mod=lambda s, b, h, q, kv: s - slopes[h] * (q - kv))


def band(width: int) -> BoundVariant:
    """A mask-only registered variant: keys at most ``width - 1`` positions back, odd query heads only one key."""
    return BoundVariant("band", mask_mod=lambda b, h, q, kv: (q - kv < width) & ((h % 2 == 0) | (q == kv)))


def layers_for(variant: str) -> list[LayerAttention]:
    """Two layers of each case; the window layers differ so that two block masks are in play."""
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    return {
        "window": [LayerAttention(SCALE, sliding_window=5), LayerAttention(SCALE, sliding_window=40)],
        "softcap": [LayerAttention(SCALE * 8, softcap=2.0)] * 2,  # scores of several units: the cap bites
        "sinks": [LayerAttention(SCALE, sinks=sinks), LayerAttention(SCALE, sinks=sinks, sliding_window=7)],
        "gemma2": [LayerAttention(SCALE * 8, softcap=2.0, sliding_window=6), LayerAttention(SCALE * 8, softcap=2.0)],
        "alibi": [LayerAttention(SCALE, mods=(alibi(HEADS),)),
                  LayerAttention(SCALE, softcap=3.0, mods=(alibi(HEADS),))],
        "band": [LayerAttention(SCALE, mods=(band(6),)), LayerAttention(SCALE, sliding_window=4, mods=(band(9),))],
    }[variant]


def reference(layer: LayerAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int) -> torch.Tensor:
    """One sequence's rows ``q [n, H, D]`` at positions ``ctx..`` against its keys ``k``, ``v [H_kv, S, D]``, with
    ``layer``'s registered mods evaluated densely on broadcast positions (as :mod:`kvcore.interfaces.variants`
    defines them) and folded into an additive mask for :func:`explicit_attention`, which does the rest."""
    n, heads, seq = q.shape[0], q.shape[1], k.shape[1]
    h, qp, kp = torch.arange(heads)[:, None, None], torch.arange(ctx, ctx + n)[None, :, None], torch.arange(seq)
    scores = (q.transpose(0, 1).float() @ k.float().repeat_interleave(heads // k.shape[0], 0).transpose(-2, -1))
    scores = scores * layer.scale
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    visible = (kp <= qp) & ((qp - kp < layer.sliding_window) if layer.sliding_window else True)
    modded = scores
    for mod in layer.mods:
        if mod.score_mod is not None:
            modded = mod.score_mod(modded, 0, h, qp, kp)
        if mod.mask_mod is not None:
            visible = visible & mod.mask_mod(0, h, qp, kp)
    bias = (modded - scores).masked_fill(~visible, float("-inf"))  # what the mods and the mask add to the scores
    plain = LayerAttention(layer.scale, softcap=layer.softcap, sinks=layer.sinks)
    return explicit_attention(q.transpose(0, 1)[None], k[None], v[None], bias[None], plain)[0].transpose(0, 1)


class Harness:
    """``flex`` on a contiguous or a (shuffled) paged cache next to ``naive`` on a contiguous one, fed the same
    random q, k, v per layer; registered mods are checked against :func:`reference` over naive's cache."""

    def __init__(self, layout: str, variant: str, dtype=torch.float32, **options):
        self.layers = layers_for(variant)
        spec = make_spec(KV_HEADS, D, layers=len(self.layers), max_seq_len=300, dtype=dtype)
        self.flex = KVCacheManager(PagedKVCache(spec) if layout == "paged" else ContiguousKVCache(spec))
        if layout == "paged":
            shuffle_pool(self.flex)
        self.naive = KVCacheManager(ContiguousKVCache(spec))
        self.backend, self.oracle = FlexBackend(**({"compile": False} | options)), NaiveBackend()
        self.dtype, self.gen = dtype, torch.Generator().manual_seed(7)

    def add(self, *seq_ids):
        for s in seq_ids:
            self.flex.add_sequence(s)
            self.naive.add_sequence(s)

    def step(self, seq_ids, query_lens, atol=2e-5):
        mf = self.flex.prepare(seq_ids, query_lens, SCALE, self.layers)
        mn = self.naive.prepare(seq_ids, query_lens, SCALE, self.layers)
        plan, oracle_plan = self.backend.plan(mf, self.flex.cache), self.oracle.plan(mn, self.naive.cache)
        total = sum(query_lens)
        for i, layer in enumerate(self.layers):
            q = torch.randn(total, HEADS, D, generator=self.gen).to(self.dtype)
            k, v = (torch.randn(total, KV_HEADS, D, generator=self.gen).to(self.dtype) for _ in range(2))
            out = self.backend.forward(i, q, k, v, self.flex.cache, plan)
            if layer.mods:
                self.naive.cache.write(i, k, v, mn)
                want = torch.cat([reference(layer, q[s:e], self.naive.cache.k[i, slot, :, : c + e - s],
                                            self.naive.cache.v[i, slot, :, : c + e - s], c)
                                  for s, e, slot, c in zip(mn.query_starts, mn.query_starts[1:], mn.slots,
                                                           mn.context_lens)])
            else:
                want = self.oracle.forward(i, q, k, v, self.naive.cache, oracle_plan)
            assert out.shape == q.shape and out.dtype == q.dtype
            torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=0)
        return plan


CASES = ["window", "softcap", "sinks", "gemma2", "alibi", "band"]


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("variant", CASES)
def test_prefill_decode_and_chunks_match_the_oracle(layout, variant):
    h = Harness(layout, variant)
    h.add(0, 1, 2)
    h.step([0, 1], [23, 9])  # a ragged prefill batch (GQA: 4 query heads on 2 KV heads)
    h.step([0, 1], [1, 1])  # a decode step, keys bucketed past the lengths
    h.step([2, 0], [40, 1])  # a new prompt beside a running decode
    h.step([1, 2], [5, 17])  # rows after a cache (speculative verification, a prefill chunk)
    h.step([2, 0, 1], [1, 1, 1])  # decode on non-consecutive slots


@pytest.mark.parametrize("layout, dtype, atol", [("contiguous", torch.bfloat16, 3e-2), ("paged", torch.float16, 3e-3)])
def test_half_precision_close_to_the_oracle(layout, dtype, atol):
    h = Harness(layout, "gemma2", dtype)
    h.add(0, 1)
    h.step([0, 1], [30, 4], atol=atol)
    h.step([0, 1], [1, 1], atol=atol)


def test_a_wrong_mod_is_caught():
    """The harness fails a backend that drops a registered mod: the comparison can fail."""
    h = Harness("contiguous", "alibi")
    h.layers = [LayerAttention(SCALE)] * 2
    h.add(0)
    plan = h.backend.plan(h.flex.prepare([0], [12], SCALE, h.layers), h.flex.cache)
    q, k, v = torch.randn(12, HEADS, D), torch.randn(12, KV_HEADS, D), torch.randn(12, KV_HEADS, D)
    plain = h.backend.forward(0, q, k, v, h.flex.cache, plan)
    with_alibi = reference(layers_for("alibi")[0], q, k.transpose(0, 1), v.transpose(0, 1), 0)
    assert (plain - with_alibi).abs().max() > 1e-2


def test_decode_keys_are_bucketed():
    """A decode step's keys are padded to a power of two (at least 128): lengths within a bucket share a shape."""
    assert [bucket(n, 128) for n in (1, 128, 129, 200, 256, 257)] == [128, 128, 256, 256, 256, 512]
    assert bucket(300, 128, most=290) == 300 and bucket(200, 128, most=220) == 220
    h = Harness("paged", "softcap")
    h.add(0)
    assert h.step([0], [100]).kv_len == 128
    lens = {h.step([0], [1]).kv_len for _ in range(40)}  # 101 .. 140 keys
    assert lens == {128, 256}


def test_eager_calls_are_padded_to_the_tile_only():
    """Eager FlexAttention reuses no kernel and computes every padded row and key, so a call is padded to the tile,
    not to a power of two (a 2,101-key call would compute 4,096 keys)."""
    assert [bucket(n, 128, compiled=False) for n in (1, 128, 129, 257)] == [128, 128, 256, 384]
    assert bucket(300, 128, most=290, compiled=False) == 300
    h = Harness("paged", "softcap")
    h.add(0)
    plan = h.step([0], [260])
    assert (plan.q_len, plan.kv_len) == (272, 384)  # compiled: 512 and 512


@pytest.mark.parametrize("window", [None, 1, 5, 127, 128, 129, 300])
def test_counted_block_masks_equal_create_block_mask(window):
    """The tiles counted from positions visit exactly the tiles ``create_block_mask`` finds by evaluating the mask:
    ragged prefills, decode rows, chunks after a cache, rows crossing a tile, windows around the tile size."""
    from torch.nn.attention.flex_attention import create_block_mask

    layer = LayerAttention(SCALE, sliding_window=window)
    for ctxs, query_lens, q_len, kv_len in [([0, 3], [200, 17], 256, 256), ([300, 1000, 5], [1, 1, 1], 1, 1024),
                                            ([130, 0], [16, 5], 16, 256), ([250], [300], 512, 640)]:
        ctx, lens = torch.tensor(ctxs), torch.tensor(query_lens)
        counted = block_mask(layer, ctx, lens, q_len, kv_len, None)
        evaluated = create_block_mask(mask_mod(layer, ctx, lens), len(ctxs), None, q_len, kv_len, device="cpu")
        assert torch.equal(counted.to_dense(), evaluated.to_dense()), (ctxs, query_lens)


def test_block_masks_are_made_once_per_distinct_mask():
    """Layers with the same window share one block mask, made in the plan; a registered mask_mod's (which may
    depend on the head) is made by the first layer that uses it."""
    band3 = band(3)
    layers = [LayerAttention(SCALE, sliding_window=5), LayerAttention(SCALE),
              LayerAttention(SCALE, sliding_window=5, softcap=2.0), LayerAttention(SCALE, mods=(band3,))]
    kv = KVCacheManager(ContiguousKVCache(make_spec(KV_HEADS, D, layers=len(layers))))
    kv.add_sequence(0)
    backend = FlexBackend(compile=False)
    plan = backend.plan(kv.prepare([0], [9], SCALE, layers), kv.cache)
    assert set(plan.masks) == {(5,), (None,)}
    q, k, v = torch.randn(9, HEADS, D), torch.randn(9, KV_HEADS, D), torch.randn(9, KV_HEADS, D)
    backend.forward(3, q, k, v, kv.cache, plan)
    assert set(plan.masks) == {(5,), (None,), (None, band3.mask_mod)}
    assert plan.masks[(None, band3.mask_mod)].shape[1] == HEADS  # one per head


def test_availability_says_why_in_one_line(monkeypatch):
    import sys

    import kvcore.backends.flex_mods as flex_mods

    monkeypatch.setattr(flex_mods, "cxx_compiler", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reason = FlexBackend.availability()
    assert "no g++ or clang++" in reason and "compile = false" in reason and "\n" not in reason
    monkeypatch.setattr(flex_mods, "cxx_compiler", lambda: "no-such-compiler --flag")
    assert "CXX='no-such-compiler --flag' names no program" in FlexBackend.availability()
    monkeypatch.setitem(sys.modules, "torch.nn.attention.flex_attention", None)  # as if torch had none
    assert "has no FlexAttention" in FlexBackend.availability()


def test_options_and_registration():
    with pytest.raises(ConfigError, match="compile must be true or false"):
        FlexBackend(compile="no")
    with pytest.raises(ConfigError):
        FlexBackend(compile=False, nonsense=1)
    caps = FlexBackend.capabilities
    assert caps.variants_as_code and caps.reasons_variants({"alibi", "sinks", "softcap", "sliding_window"}) == []
    assert caps.kv_layouts == ("contiguous", "paged")
    assert get_registry().get("flex", BACKEND).cls is FlexBackend


@pytest.mark.parametrize("kv_cache", [None, "paged"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_greedy_streams_equal_naive(family, kv_cache):
    """fp32 greedy tokens of a tiny model through the engine (chunked prefill, batching) equal naive's: a Llama, and
    a Gemma 3 (five window layers to one global; on the paged cache its window layers give blocks
    back, so they read their own block tables)."""
    model = make_random_model(num_layers=2) if family == "llama" else make_random_gemma3(window=7)
    prompts = [[1, 5, 9, 13, 17], list(range(10, 60)), [7, 8]]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)

    def run(backend, **cfg):
        config = EngineConfig(backend=backend, max_model_len=128, max_num_batched_tokens=32, **cfg)
        return [r.token_ids for r in Engine(model, None, config).generate(prompts, params)]

    flex = run("flex", kv_cache=kv_cache, backend_options={"flex": {"compile": False}})
    assert flex == run("naive")


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache", [None, "paged"])
def test_smollm2_golden_prompts_match_transformers(smollm2, kv_cache):
    """The golden prompts (SmolLM2, float32, batched and ragged) through flex give transformers' greedy ids."""
    check_against_golden(smollm2, load_golden("golden_smollm2.json"), "flex", 11, FIRST_TOKENS, kv_cache=kv_cache,
                         backend_options={"flex": {"compile": False}})


# -- compiled kernels and their cache ------------------------------------------------------------------------

@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "kvcore-cache"
    monkeypatch.setenv("KVCORE_CACHE_DIR", str(root))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # recorded, so the folder set below is undone after the test
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    return root


def test_inductor_cache_is_private_under_kvcore(cache_dir, monkeypatch):
    folder = use_kvcore_inductor_cache()
    assert folder == cache_dir / "inductor" and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/the/user/chose")
    assert str(use_kvcore_inductor_cache()) == "/somewhere/the/user/chose"  # the user's own choice stays


def test_an_untrusted_inductor_cache_is_refused(cache_dir):
    cache_dir.mkdir(mode=0o700)
    (cache_dir / "inductor").mkdir(mode=0o777)
    os.chmod(cache_dir / "inductor", 0o777)  # whatever the umask
    with pytest.raises(CacheTrustError, match="inductor"):
        use_kvcore_inductor_cache()


def test_an_unwritable_cache_means_a_private_temporary_one(cache_dir, monkeypatch):
    cache_dir.write_text("")  # no folder can be made under it
    with pytest.warns(RuntimeWarning, match="compiled-kernel cache.*running without it"):
        folder = use_kvcore_inductor_cache()
    assert not folder.is_relative_to(cache_dir) and stat.S_IMODE(os.lstat(folder).st_mode) == 0o700
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    folder.rmdir()


def decode_graphs(h: Harness) -> tuple[int, int]:
    """Graphs dynamo made for flex_attention: after a prefill and one decode step, then after six more decode
    steps whose key counts (22 .. 27) share one bucket."""
    import torch._dynamo.utils as dynamo_utils

    h.add(0)
    h.step([0], [20], atol=1e-4)
    h.step([0], [1], atol=1e-4)
    before = dynamo_utils.counters["stats"]["unique_graphs"]
    for _ in range(6):
        h.step([0], [1], atol=1e-4)
    return before, dynamo_utils.counters["stats"]["unique_graphs"]


def test_compiled_flex_keeps_compiling_new_shapes_instead_of_falling_back_to_eager(cache_dir):
    """Past dynamo's recompile limits (per function, and over all functions) every later shape would run through
    its eager fallback: a conformance run meets hundreds of shapes, so the compiled backend raises both."""
    config = torch._dynamo.config
    with config.patch(recompile_limit=8, accumulated_recompile_limit=256):  # torch's defaults, restored after
        FlexBackend()
        assert config.recompile_limit == config.accumulated_recompile_limit == RECOMPILE_LIMIT


def test_decode_steps_in_one_bucket_trace_no_new_graph():
    """Eager FlexAttention traces its call with dynamo too (without inductor): the buckets keep that to one trace
    per shape, as they keep the compiled kernels to one per shape (the compiled test below)."""
    torch._dynamo.reset()
    before, after = decode_graphs(Harness("contiguous", "window"))
    assert before > 0 and after == before


@pytest.mark.full  # compiling on a loaded 2-core machine takes minutes; the eager test above is its bounded form
@pytest.mark.skipif(flex_reason() is not None, reason="no C++ compiler for torch.compile")
def test_compiled_matches_the_oracle_without_recompiling_per_length(cache_dir):
    """The compiled kernel agrees with naive, decode steps within a key bucket reuse it, and its files land in
    kvcore's cache folder."""
    torch._dynamo.reset()
    before, after = decode_graphs(Harness("contiguous", "window", compile=True))
    assert before > 0 and after == before
    assert any((cache_dir / "inductor").rglob("*.so")) or any((cache_dir / "inductor").rglob("*.py"))


class EagerFlex(FlexBackend):
    name = "planted_eager_flex"

    def __init__(self, **options):
        super().__init__(**({"compile": False} | options))


class StaleMasks(EagerFlex):
    """flex with a planted bug: block masks kept from the first call of each padded shape, not rebuilt for the
    lengths of the call (as if made once and reused after the cache grew)."""

    name = "planted_stale_flex_masks"
    kept: dict = {}

    def plan(self, meta, cache):
        plan = super().plan(meta, cache)
        for key, mask in list(plan.masks.items()):
            plan.masks[key] = self.kept.setdefault((key, plan.q_len, plan.kv_len), mask)
        return plan


def test_a_block_mask_stale_after_the_cache_grows_is_caught():
    """The op tier's variant rows (a window, a soft-cap; each on both caches) fail flex when its block masks
    outlive the lengths they were made for, and pass the same backend rebuilding them."""
    from kvcore.conformance.attention_cases import variant_cases
    from kvcore.conformance.results import FAIL, PASS
    from kvcore.conformance.runner import run_case
    from kvcore.conformance.settings import SuiteConfig
    from kvcore.conformance.target import resolve_target

    cfg = SuiteConfig(quick=True, dtype="float32")

    def statuses(cls):
        target = resolve_target(cls)
        cases = [c for c in variant_cases(target.cache_names()) if c.attention in ("window7", "softcap")]
        return {c.id: run_case(target, "op", c, cfg).status for c in cases}

    assert set(statuses(EagerFlex).values()) == {PASS}
    StaleMasks.kept.clear()
    assert set(statuses(StaleMasks).values()) == {FAIL}
