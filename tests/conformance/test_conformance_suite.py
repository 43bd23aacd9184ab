"""The conformance library: built-ins pass, capability-aware skips, unavailability, tie-aware streams,
reports. CI-sized: quick case sets on the in-memory tiny model."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvcore import AttentionBackend, BackendCapabilities, hookimpl
from kvcore.backends.sdpa import SDPABackend
from kvcore.conformance import op_tier, tolerances
from kvcore.conformance.attention_cases import variant_cases
from kvcore.conformance.cases import (
    BLOCK_SIZES,
    HEAD_DIMS,
    HEAD_LAYOUTS,
    HEAD_SIZES,
    LAYOUTS,
    LEGACY_SCENARIOS,
    SCENARIOS,
    SHORT_SCENARIOS,
    Fork,
    covering_array,
    op_cases,
)
from kvcore.conformance.driver import Stream
from kvcore.conformance.report import to_json, to_markdown, to_text
from kvcore.conformance.results import EXIT_FAIL, EXIT_PASS, EXIT_UNAVAILABLE, FAIL, PASS, SKIP, CaseResult
from kvcore.conformance.runner import run_suite
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.stream_tier import compare_streams
from kvcore.conformance.target import resolve_target
from kvcore.errors import ConfigError, UnknownBackendError
from kvcore.plugins.registry import PluginRegistry

QUICK_TINY = SuiteConfig(quick=True, models=("tiny",))


pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module")
def registry():
    reg = PluginRegistry(load_entrypoints=False)
    reg.backends  # noqa: B018 - load the built-ins
    return reg


# -- the case matrix ------------------------------------------------------------------------------------
def test_full_matrix_covers_layouts_head_dims_and_scenarios():
    cases = op_cases(quick=False)
    legacy = {(layout, d, s) for layout in HEAD_LAYOUTS for d in HEAD_DIMS for s in LEGACY_SCENARIOS}
    assert legacy <= {(c.layout, c.head_dim, c.scenario) for c in cases if c.block_size == 16}
    assert {LAYOUTS[c.layout] for c in cases} >= {(8, 8), (8, 2), (8, 1)}  # MHA, GQA, MQA
    lens = {n for c in cases for call in c.calls if not isinstance(call, Fork) for _, n in call}
    assert {1, 15, 16, 17, 33} <= lens  # prefill lengths around the 16-token block boundary
    assert max(max(c.final_lens) for c in cases) == 4096  # the engine's default context limit
    quick = op_cases(quick=True)
    assert set(SCENARIOS) - {c.scenario for c in quick} == {"long4k"} and len(quick) < len(cases)
    assert max(max(c.final_lens) for c in quick) > 2048  # split-KV / tiled paths in --quick


DIMS = {"layout": set(LAYOUTS), "head_dim": set(HEAD_SIZES), "block_size": set(BLOCK_SIZES),
        "scenario": set(SHORT_SCENARIOS)}


def test_quick_covers_every_value_of_every_dimension_once_over():
    """--quick: each value of each dimension (layout, head size, block size, scenario) in some case, in float32 and
    in each reduced precision, and few cases beyond that: the dimensions, not their combinations (full's job)."""
    cases = op_cases(quick=True, dtypes=(torch.float32, torch.bfloat16, torch.float16))
    for dtype in (None, torch.bfloat16, torch.float16):
        rows = [c for c in cases if c.dtype == dtype or (dtype is None and c.dtype == torch.float32)]
        for name, values in DIMS.items():
            assert {getattr(c, name) for c in rows} >= values, (dtype, name)
    fp32 = [c for c in cases if c.dtype == torch.float32]
    assert len(fp32) < len(op_cases(quick=False)) / 4 and sum(c.scenario == "long2k" for c in fp32) == 1


def test_full_covers_every_pair_of_dimension_values():
    """Pairwise: any two values of any two dimensions (layout, head size, block size, scenario) meet in
    at least one case, so a bug needing one value of each of two dimensions is reached."""
    cases = op_cases(quick=False)
    dims = DIMS
    rows = {(c.layout, c.head_dim, c.block_size, c.scenario) for c in cases}
    long2k = [c for c in cases if c.scenario == "long2k"]  # long contexts with every layout, head size, block size
    assert {c.layout for c in long2k} == dims["layout"] and {c.head_dim for c in long2k} == dims["head_dim"]
    assert {c.block_size for c in long2k} == dims["block_size"]
    names = list(dims)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            seen = {(r[i], r[names.index(b)]) for r in rows}
            missing = {(x, y) for x in dims[a] for y in dims[b]} - seen
            assert not missing, (a, b, sorted(missing)[:5])
    groups = {h // hkv for h, hkv in LAYOUTS.values()}
    assert {1, 2, 3, 5, 6, 8} <= groups and any(hkv == 1 for _, hkv in LAYOUTS.values())
    assert {40, 72, 80, 96, 112, 256} <= set(HEAD_SIZES) and 12 in BLOCK_SIZES and 1 in BLOCK_SIZES


def test_covering_array_is_deterministic_and_small():
    dims = {"a": range(5), "b": range(4), "c": range(3)}
    rows = covering_array(dims, seed=7)
    assert rows == covering_array(dims, seed=7)
    assert 20 <= len(rows) <= 26  # at least |a|x|b| = 20; greedy stays close to it
    once = covering_array(dims, seed=7, strength=1)
    assert len(once) == 5 and all({r[n] for r in once} == set(dims[n]) for n in dims)


def test_reduced_precisions_get_their_own_smaller_case_list():
    cases = op_cases(quick=True, dtypes=(torch.float32, torch.bfloat16, torch.float16))
    by_dtype = {d: [c for c in cases if c.dtype == d] for d in (torch.float32, torch.bfloat16, torch.float16)}
    assert len(by_dtype[torch.bfloat16]) == len(by_dtype[torch.float16]) < len(by_dtype[torch.float32])
    assert all(c.id.endswith("-bf16") for c in by_dtype[torch.bfloat16])
    assert any(max(c.final_lens) > 2048 for c in by_dtype[torch.bfloat16])  # a long reduction in reduced precision


def test_multi_cache_backends_run_every_case_per_cache():
    cases = op_cases(quick=True, kv_caches=("contiguous", "paged"))
    assert {c.kv_cache for c in cases} == {"contiguous", "paged"}
    assert len(cases) == 2 * len(op_cases(quick=True))


def test_quick_runs_each_case_on_one_cache_and_every_cache_meets_every_scenario_and_precision():
    target = resolve_target("flex")  # reads both layouts: two caches under test
    caches = target.cache_names()
    assert len(caches) == 2
    every_dtype = SuiteConfig(quick=True)
    cases = op_tier.cases(target, every_dtype)
    plain = op_cases(quick=True, dtypes=every_dtype.dtypes) + variant_cases(None, every_dtype.dtypes)
    assert sorted(dataclasses.replace(c, kv_cache=None).id for c in cases) == sorted(c.id for c in plain)
    for name in caches:
        mine = [c for c in cases if c.kv_cache == name]
        assert {c.scenario for c in mine} >= set(SHORT_SCENARIOS) | {"long2k"}, name
        for dtype in every_dtype.dtypes[1:]:  # each reduced precision: its long reduction on every cache too
            assert {c.scenario for c in mine if c.dtype == dtype} >= {"ragged", "fragmented", "long2k"}, (name, dtype)
        assert {c.block_size for c in mine} == set(BLOCK_SIZES), name
    full = op_tier.cases(target, dataclasses.replace(every_dtype, quick=False))
    assert len(full) == 2 * len({dataclasses.replace(c, kv_cache=None).id for c in full})


def test_tolerance_table_is_documented_for_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert tolerances.op_tolerance(dtype).atol > 0
        assert tolerances.cache_tolerance(dtype).rtol > 0
    assert tolerances.op_tolerance(torch.float32).atol <= 1e-5
    assert tolerances.tie_rule(torch.float32).exact
    assert not tolerances.tie_rule(torch.bfloat16).exact


# -- built-in backends pass -----------------------------------------------------------------------------
@pytest.mark.parametrize("name, dtype", [("naive", "float32"), ("sdpa", None), ("paged", "float32")])
def test_cpu_builtins_pass_quick_suite(registry, name, dtype):
    """sdpa with the default dtypes (float32 and both reduced precisions); naive and paged in float32 here
    (every dtype in the documented CLI runs)."""
    report = run_suite(name, dataclasses.replace(QUICK_TINY, dtype=dtype), registry=registry)
    assert report.status == PASS, to_text(report)
    assert report.exit_code == EXIT_PASS
    assert set(report.tiers) == {"op", "cache", "stream", "sampling", "speculative"}
    for tier in report.tiers:
        assert report.tier_status(tier) == PASS
    op = [r for r in report.results if r.tier == "op"]
    ran = [r for r in op if r.status == PASS]  # sdpa skips the variants-as-code rows with the reason
    assert max(r.max_err for r in ran if not r.case.endswith(("-bf16", "-fp16"))) < 1e-5
    if dtype is None:
        assert {r.case[-5:] for r in op} >= {"-bf16", "-fp16"}  # reduced precisions run by default
    assert {r.case for r in report.results if r.tier == "stream"} >= {"tiny-churn"}


def test_fragmented_paged_cache_gets_shuffled_block_tables(registry):
    """The fragmented scenario really hands the case non-contiguous, out-of-order blocks."""
    from kvcore.backends.paged import PagedKVCache
    from kvcore.conformance.op_tier import _fragment
    from kvcore.interfaces.kv_cache import CacheSpec
    from kvcore.scheduling.kv_manager import KVCacheManager

    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32, device=torch.device("cpu"),
                     max_num_seqs=6, max_seq_len=80, block_size=16)
    cache = KVCacheManager(PagedKVCache(spec))
    live = _fragment(cache, torch.Generator().manual_seed(0), 1.0)
    assert live
    cache.add_sequence(1)
    cache.prepare([1], [64], 1.0)
    table = cache.blocks.block_table(1)
    assert table != sorted(table) and table != list(range(table[0], table[0] + len(table)))


# -- availability and capabilities ---------------------------------------------------------------------
class _Unavailable(AttentionBackend):
    name = "conformance_unavailable"
    capabilities = BackendCapabilities(devices=frozenset({"cuda"}), dtypes=frozenset({torch.float16}),
                                       kv_layouts=("contiguous",))

    @classmethod
    def availability(cls):
        return "needs a CUDA device (none found)"

    def forward(self, *args):  # pragma: no cover - never called
        raise AssertionError("unavailable backends must not run")


def test_unavailable_backend_is_reported_not_failed():
    report = run_suite(_Unavailable, QUICK_TINY)
    assert report.status == "unavailable" and report.exit_code == EXIT_UNAVAILABLE
    assert report.unavailable == "needs a CUDA device (none found)"
    assert not report.results
    assert "unavailable" in to_text(report).lower() and "CUDA" in to_text(report)


def test_gpu_builtins_on_cpu_are_unavailable_with_reason():
    reg = PluginRegistry(load_entrypoints=False)
    gpu = [n for n in ("flash_attn2", "xformers") if n in reg.backends]
    if not gpu:
        pytest.skip("GPU built-ins not present in this checkout")
    for name in gpu:
        if reg.backends[name].availability() is None:
            continue  # a machine that can run it
        report = run_suite(name, QUICK_TINY, registry=reg)
        assert report.exit_code == EXIT_UNAVAILABLE and report.unavailable


class _Limited(SDPABackend):
    """sdpa, but declaring MHA only, head_dim 64 only, float32 only."""

    name = "conformance_limited"
    capabilities = BackendCapabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}),
                                       kv_layouts=("contiguous",), head_dims=frozenset({64}), supports_gqa=False)


def test_undeclared_capabilities_are_skipped_with_reason():
    report = run_suite(_Limited, dataclasses.replace(QUICK_TINY, tiers=("op", "cache")))
    op = report.by_tier("op")
    ran = [r for r in op if r.status == PASS]
    assert ran and all(r.info["shapes"]["head_dim"] == 64 and r.case.startswith("mha") for r in ran)
    skipped = [r for r in op if r.status == SKIP]
    assert any("head_dim 32 not supported" in r.detail for r in skipped)
    assert any("grouped-query attention" in r.detail for r in skipped)
    # the tiny model is GQA with head_dim 32: every model-level case is skipped, with that reason; the cache
    # driven directly involves no backend
    model_cases = [r for r in report.by_tier("cache") if r.case != "store"]
    assert model_cases and all(r.status == SKIP and "grouped-query" in r.detail for r in model_cases)
    assert report.exit_code == EXIT_PASS


def test_nothing_testable_is_not_a_pass():
    report = run_suite(_Limited, dataclasses.replace(QUICK_TINY, dtype="bfloat16", tiers=("op",)))
    assert report.status == "untested" and report.exit_code == EXIT_UNAVAILABLE
    assert all("dtype bfloat16 not supported" in r.detail for r in report.results)


def test_resolve_target_forms(registry):
    assert resolve_target("sdpa", registry).name == "sdpa"
    t = resolve_target("kvcore.backends.naive:NaiveBackend")
    assert t.name == "naive" and "naive" in t.registry.backends
    with pytest.raises(UnknownBackendError, match="did you mean 'sdpa'"):
        resolve_target("sdpaa", registry)
    with pytest.raises(ConfigError, match="cannot import"):
        resolve_target("kvcore.nope:Thing")


def test_throwaway_plugin_in_a_registry(registry):
    """A plugin registered at run time is testable by name; unregistered afterwards (datasette style)."""

    class Plugin:
        @hookimpl
        def kvcore_register_backends(self, register):
            register(_Limited)

    name = registry.register_plugin(Plugin(), name="conformance-throwaway")
    try:
        report = run_suite("conformance_limited", dataclasses.replace(QUICK_TINY, tiers=("op",)), registry=registry)
        assert report.exit_code == EXIT_PASS
    finally:
        registry.unregister_plugin(name)
    assert "conformance_limited" not in registry.backends


# -- tie-aware stream comparison --------------------------------------------------------------------------
def _stream(tokens, rows):
    return Stream(tokens, torch.tensor(rows, dtype=torch.float32))


def test_fp32_streams_must_match_exactly():
    ref = _stream([0, 1], [[5.0, 1.0, 0.0], [0.0, 5.0, 4.99]])
    got = _stream([0, 2], [[5.0, 1.0, 0.0], [0.0, 4.99, 5.0]])
    c = compare_streams(ref, got, tolerances.tie_rule(torch.float32))
    assert not c["equal"] and not c["tie"] and c["step"] == 1
    assert (c["ref_token"], c["got_token"]) == (1, 2)
    assert c["ref_margin"] == pytest.approx(0.01, abs=1e-4) and c["got_margin"] == pytest.approx(0.01, abs=1e-4)


def test_reduced_precision_accepts_a_near_tie_and_stops_there():
    ref = _stream([0, 1, 7], [[5.0, 1.0, 0.0], [0.0, 5.0, 4.9], [0.0, 0.0, 0.0]])
    got = _stream([0, 2, 9], [[5.0, 1.0, 0.0], [0.0, 4.9, 5.0], [9.0, 0.0, 0.0]])
    c = compare_streams(ref, got, tolerances.tie_rule(torch.bfloat16))
    assert c["tie"] and c["step"] == 1


def test_reduced_precision_rejects_a_clear_divergence():
    ref = _stream([0, 1], [[5.0, 1.0, 0.0], [0.0, 9.0, 1.0]])
    got = _stream([0, 2], [[5.0, 1.0, 0.0], [0.0, 1.0, 9.0]])
    c = compare_streams(ref, got, tolerances.tie_rule(torch.bfloat16))
    assert not c["tie"] and c["ref_margin"] == pytest.approx(8.0)


# -- reports ------------------------------------------------------------------------------------------
def _fake_report():
    from kvcore.conformance.results import SuiteReport

    r = SuiteReport(backend="x", settings=QUICK_TINY.as_dict(), tiers=["op", "stream"])
    r.results = [
        CaseResult("op", "gqa8x2-d64-ragged", PASS, "ok", max_err=1e-7),
        CaseResult("op", "mha8x8-d32-ragged", FAIL, "call 2/5 (decode ...) max |err| 0.5", max_err=0.5),
        CaseResult("stream", "tiny-batch", SKIP, "dtype bfloat16 not supported"),
    ]
    return r


def test_reports_name_tier_case_and_detail():
    r = _fake_report()
    assert r.exit_code == EXIT_FAIL and r.tier_status("op") == FAIL and r.tier_status("stream") == SKIP
    text = to_text(r)
    assert "[op] mha8x8-d32-ragged: FAIL" in text and "max |err| 0.5" in text and "RESULT: FAIL (exit 1)" in text
    md = to_markdown(r)
    assert "## Failures" in md and "### [op] mha8x8-d32-ragged" in md and "## Tolerances" in md
    data = json.loads(to_json(r))
    assert data["exit_code"] == 1 and data["tiers"]["op"] == {"status": "fail", "pass": 1, "fail": 1, "skip": 0}
    assert data["results"][1]["max_err"] == 0.5
