"""The op tier's attention-variant dimension (kvcore/conformance/attention_cases.py): the built-in backends
pass it, a backend not declaring a variant skips with the reason, and planted bugs in windows, soft-caps,
sinks and variants as code (score_mod / mask_mod) are caught, among them a long-context decode path without
the window and window bounds computed from positions in the model dtype (the long windowed rows,
attention_cases.LONG_ROWS)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from kvcore.backends.contiguous import ALL_DTYPES
from kvcore.backends.naive import NaiveBackend
from kvcore.conformance.attention_cases import LONG_ROWS, PATTERNS, variant_cases
from kvcore.conformance.cases import BLOCK_SIZE, Fork
from kvcore.conformance.results import FAIL, PASS, SKIP
from kvcore.conformance.runner import run_case, tier_cases
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import resolve_target
from kvcore.interfaces.attention import BackendCapabilities, causal_mask
from kvcore.interfaces.layer_attention import VARIANTS
from kvcore.kernels.cpu_kernels import kernel_reasons

try:
    from kvcore_example_backend.backend import ChunkedAttentionBackend
except ImportError:  # the example package is not installed: use it from the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "kvcore-example-backend" / "src"))
    from kvcore_example_backend.backend import ChunkedAttentionBackend

CFG = SuiteConfig(quick=True, dtype="float32")
ALL_PRECISIONS = SuiteConfig(quick=True)  # what a run certifies by default: float32, bfloat16, float16


class Textbook(NaiveBackend):
    """naive's algorithm, with one of the planted bugs switched on by ``bug``."""

    name = "planted_textbook"
    bug: str | None = None

    def forward(self, layer_idx, q, k, v, cache, meta):
        cache.write(layer_idx, k, v, meta)
        layer = meta.layer(layer_idx)
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        starts = meta.cu_seqlens_q.tolist()
        for i, (slot, ctx, n) in enumerate(zip(meta.slots, meta.context_lens, meta.query_lens)):
            seq_len = ctx + n
            Q = q[starts[i] : starts[i + 1]].transpose(0, 1).float()  # (H, n, D)
            K = cache.k[layer_idx, slot, :, :seq_len].float().repeat_interleave(group, 0)  # (H, S, D)
            V = cache.v[layer_idx, slot, :, :seq_len].float().repeat_interleave(group, 0)
            S = Q @ K.transpose(-2, -1) * layer.scale
            window = layer.sliding_window
            if self.bug == "long_decode_ignores_window" and n == 1 and seq_len > 512:
                window = None  # the split-KV decode path taken past 512 keys, written without the window
            mask = causal_mask(ctx, n, q.device, window)
            if window is not None and self.bug == "window_positions_in_model_dtype":
                # positions held in q's dtype: bfloat16 holds integers exactly only up to 256, float16 up to 2048
                query_pos = torch.arange(ctx, seq_len).to(q.dtype)[:, None]
                key_pos = torch.arange(seq_len).to(q.dtype)[None, :]
                mask = causal_mask(ctx, n, q.device) & (key_pos > query_pos - window)
            if window is not None and self.bug == "window_off_by_one_at_block_boundary":
                first = torch.arange(ctx, seq_len)[:, None] - layer.sliding_window + 1  # first key in the window
                at_boundary = first % BLOCK_SIZE == 0  # a kernel's 16-key block (a contiguous cache has none)
                mask = mask | (at_boundary & (torch.arange(seq_len)[None, :] == first - 1))  # one key too many
            if layer.softcap is not None and self.bug != "softcap_after_mask":
                S = torch.tanh(S / layer.softcap) * layer.softcap
            b, h = torch.tensor(i), torch.arange(q.shape[1])[:, None, None]
            q_pos, kv_pos = torch.arange(ctx, seq_len)[None, :, None], torch.arange(seq_len)[None, None, :]
            for mod in layer.mods:
                if mod.score_mod is not None and self.bug != "score_mod_after_mask":
                    S = mod.score_mod(S, b, h, q_pos, kv_pos)
                if mod.mask_mod is not None:  # the bug asks about the key one position later
                    mask = mask & mod.mask_mod(b, h, q_pos, kv_pos + (self.bug == "mask_mod_off_by_one"))
            S = S.masked_fill(~mask, float("-inf"))
            for mod in layer.mods if self.bug == "score_mod_after_mask" else ():
                S = mod.score_mod(S, b, h, q_pos, kv_pos)  # the probe's maps -inf to a finite score: masked keys show
            if layer.softcap is not None and self.bug == "softcap_after_mask":
                S = torch.tanh(S / layer.softcap) * layer.softcap  # masked keys become -c: visible
            sinks = layer.sinks
            if sinks is not None and not (self.bug == "sink_dropped_in_decode" and meta.is_decode):
                S = torch.cat([S, sinks.float()[:, None, None].expand(-1, n, 1)], dim=-1)
            P = S.softmax(dim=-1)[..., :seq_len]
            out[starts[i] : starts[i + 1]] = (P @ V).transpose(0, 1).to(q.dtype)
        return out


def planted(bug: str | None) -> type:
    return type(f"Textbook_{bug}", (Textbook,), {"bug": bug, "name": f"planted_{bug}"})


def _results(cls) -> dict[str, str]:
    """Attention (pattern, + variants as code) -> status of the short variant rows (the long ones have tests of
    their own, below)."""
    return {a: r.status for a, r in _full_results(cls).items()}


def _full_results(cls, cfg: SuiteConfig = CFG, registry=None) -> dict:
    target = resolve_target(cls, registry=registry)
    selected = [target.registry.create_variant(n) for n in cfg.attention_variants]
    cases = [c for c in variant_cases(target.cache_names(), selected=selected) if c.scenario != "long2k"]
    return {c.attention: run_case(target, "op", c, cfg) for c in cases}


def test_variant_cases_are_in_the_op_tier():
    ids = {c.id for c in tier_cases(resolve_target("naive"), "op", CFG)}
    assert {c.id for c in variant_cases()} <= ids
    assert set(PATTERNS) == {c.pattern for c in variant_cases()}  # every pattern has a row
    assert {c.attention for c in variant_cases() if c.variants} == {"plain+conformance-probe",
                                                                   "window13-softcap+conformance-probe"}


def test_the_correct_textbook_passes_every_pattern():
    assert set(_results(planted(None)).values()) == {PASS}


@pytest.mark.parametrize("bug, caught", [
    ("window_off_by_one_at_block_boundary",
     {"window16", "window7", "window20", "window13-softcap", "window1", "mixed", "window13-softcap+conformance-probe"}),
    ("softcap_after_mask", {"softcap", "window13-softcap", "mixed", "window13-softcap+conformance-probe"}),
    ("sink_dropped_in_decode", {"sinks", "mixed"}),
    ("score_mod_after_mask", {"plain+conformance-probe", "window13-softcap+conformance-probe"}),
    ("mask_mod_off_by_one", {"plain+conformance-probe", "window13-softcap+conformance-probe"}),
])
def test_planted_variant_bugs_are_caught(bug, caught):
    results = _results(planted(bug))
    failed = {p for p, status in results.items() if status == FAIL}
    assert failed and failed <= caught, results  # caught, and only where the bug acts


@pytest.mark.parametrize("bug, layer", [("score_mod_after_mask", "layer 0"), ("mask_mod_off_by_one", "layer 1")])
def test_a_planted_mod_bug_names_the_variant_and_the_first_differing_element(bug, layer):
    """The probe's mask has holes on the second layer only: a mask_mod bug first shows there."""
    detail = _full_results(planted(bug))["plain+conformance-probe"].detail
    assert f"{layer} (conformance-probe): attention output diverges from the reference" in detail, detail
    assert "worst at seq" in detail and "got " in detail and "expected " in detail, detail


def test_a_selected_registered_variant_gets_op_cases_that_catch_a_planted_bug():
    from helpers import make_plugin, registered

    from kvcore.interfaces.variants import AttentionVariant, BoundVariant
    from kvcore.plugins.registry import PluginRegistry

    class Dilated(AttentionVariant):
        name = "dilated"

        def bind(self, shape):
            return BoundVariant(self.name, mask_mod=lambda b, h, q, kv: (q - kv) % 2 == 0)

    registry = PluginRegistry(load_entrypoints=False)
    cfg = dataclasses.replace(CFG, attention_variants=("dilated",))
    with registered(registry, make_plugin(variants=[Dilated]), "dilated-plugin"):
        ids = {c.id for c in tier_cases(resolve_target("naive", registry=registry), "op", cfg)}
        assert {"gqa8x2-d64-mixed-bs12-plain+dilated", "gqa6x2-d40-ragged-window13-softcap+dilated"} <= ids
        assert {a: r.status for a, r in _full_results(planted(None), cfg, registry).items()
                if "dilated" in a} == {"plain+dilated": PASS, "window13-softcap+dilated": PASS}
        bad = _full_results(planted("mask_mod_off_by_one"), cfg, registry)["plain+dilated"]
        assert bad.status == FAIL and "layer 0 (dilated)" in bad.detail, bad.detail
        skipped = _full_results("sdpa", cfg, registry)["plain+dilated"]
        assert skipped.status == SKIP
        assert skipped.detail == "prefill: no variant 'dilated'; decode: no variant 'dilated'"


def test_conformance_cli_refuses_an_unknown_variant(capsys):
    from helpers import run_cli

    rc, _, err = run_cli(capsys, "conformance", "--backend", "naive", "--attention-variant", "nope", "--tier", "op")
    assert rc == 2 and "unknown attention variant 'nope'" in err


def _long_results(cls) -> dict:
    """The long windowed rows, in every precision (the rest of the variant rows never pass 70 keys)."""
    target = resolve_target(cls)
    cases = [c for c in variant_cases(target.cache_names(), ALL_PRECISIONS.dtypes) if c.scenario == "long2k"]
    return {c.id: run_case(target, "op", c, ALL_PRECISIONS) for c in cases}


def _decode_positions(case) -> list[int]:
    """Positions of the case's decode rows (one new token after a cache)."""
    lens, positions = [0] * case.num_seqs, []
    for call in case.calls:
        if isinstance(call, Fork):
            lens[call.dst] = lens[call.src]
            continue
        positions += [lens[i] for i, n in call if n == 1 and lens[i] > 0]
        for i, n in call:
            lens[i] += n
    return positions


def test_long_windowed_rows_cover_the_long_context_dimensions():
    """Issue #57: past every decode-path switch (no backend declares one: past 2,048 keys), decode rows whose
    windows start inside a block and inside a 64-key chunk, positions past 256 and 2,048, every precision."""
    cases = [c for c in variant_cases(None, ALL_PRECISIONS.dtypes) if c.scenario == "long2k"]
    assert {c.dtype for c in cases} == set(ALL_PRECISIONS.dtypes) == set(LONG_ROWS)
    for case in cases:
        assert max(case.final_lens) > 2048
        late = [p for p in _decode_positions(case) if p > 2048]
        assert late and any(256 < p < 2048 for p in _decode_positions(case))
        for window, _, _ in PATTERNS[case.pattern]:
            starts = [p - window + 1 for p in late]
            assert any(s % case.block_size and s % 64 for s in starts), (case.id, window)


def test_the_reference_masks_long_windows_from_integer_positions():
    mask = causal_mask(2100, 3, torch.device("cpu"), 61)  # the decode rows at 2,100..2,102
    assert mask.sum(dim=1).tolist() == [61, 61, 61]
    assert mask.int().argmax(dim=1).tolist() == [2040, 2041, 2042]  # first visible key


def test_a_long_context_decode_path_without_the_window_is_caught():
    """Planted: decode rows past 512 keys take a path that forgets the sliding window. Every short variant row
    stays under 512 keys, so only the long rows catch it: in every precision, at the first decode step past
    2,048 keys, naming the layer's window, the keys it should see and the values."""
    results = _long_results(planted("long_decode_ignores_window"))
    assert all(r.status == FAIL for r in results.values()), results
    detail = results["gqa8x2-d64-long2k-window1000-window61"].detail
    assert detail.startswith("call 3/5 (decode; seqs [0, 1], query_lens [1, 1], context_lens [2100, 301]) "
                             "layer 0 (window 1000): attention output diverges from the reference"), detail
    assert "position 2100, window keys 1101..2100)" in detail and "got " in detail and "dtype=float32" in detail
    assert set(_results(planted("long_decode_ignores_window")).values()) == {PASS}  # no short row passes 512 keys


def test_window_bounds_from_positions_in_the_model_dtype_are_caught():
    """Planted: the window mask compares positions cast to the model dtype. float32 holds them exactly (every
    float32 row passes); bfloat16 rounds positions past 256, so the bfloat16 long row fails, naming the dtype,
    the window and the first row off."""
    cls = planted("window_positions_in_model_dtype")
    results = _long_results(cls)
    failed = {i for i, r in results.items() if r.status == FAIL}
    assert "mqa6x1-d64-long2k-bs12-window1000-window61-bf16" in failed, results
    assert failed <= {i for i in results if i.endswith(("-bf16", "-fp16"))}, results
    detail = results["mqa6x1-d64-long2k-bs12-window1000-window61-bf16"].detail
    assert "(window " in detail and "window keys" in detail and "dtype=bfloat16" in detail, detail
    assert set(_results(cls).values()) == {PASS}  # short rows: positions under 256


@pytest.mark.parametrize("backend", ["naive", "sdpa", "paged", "cpu_decode", "example_chunked"])
def test_built_in_backends_pass_the_long_windowed_rows(backend):
    if backend == "cpu_decode" and kernel_reasons():
        pytest.skip("; ".join(kernel_reasons()))
    results = _long_results(ChunkedAttentionBackend if backend == "example_chunked" else backend)
    for case_id, result in results.items():
        assert result.status == PASS or (result.status == SKIP and "dtype" in result.detail), (case_id, result.detail)


def test_a_backend_not_declaring_a_variant_is_skipped_with_the_reason():
    class WindowsOnly(Textbook):
        name = "windows_only"
        capabilities = BackendCapabilities(
            devices=frozenset({"cpu"}), dtypes=ALL_DTYPES, kv_layouts=("contiguous",),
            prefill_variants=frozenset(VARIANTS), decode_variants=frozenset({"sliding_window"}),
        )

    target = resolve_target(WindowsOnly)
    by_pattern = {c.attention: run_case(target, "op", c, CFG) for c in variant_cases(target.cache_names())}
    assert by_pattern["window7"].status == PASS
    assert by_pattern["softcap"].status == SKIP and by_pattern["softcap"].detail == "decode: no soft-capping"
    assert by_pattern["sinks"].detail == "decode: no attention sinks"


def test_stream_tier_runs_a_windowed_soft_capped_model():
    """The stream tier's ``tiny-local`` model (a local layer, soft-capped scores): a backend that declares the
    variants but attends as if every layer were plain diverges from the reference stream."""

    class IgnoresLayerSpecs(NaiveBackend):
        name = "planted_ignores_layer_specs"

        def forward(self, layer_idx, q, k, v, cache, meta):
            return super().forward(layer_idx, q, k, v, cache, dataclasses.replace(meta, layers=()))

    cfg = SuiteConfig(quick=True, dtype="float32", models=("tiny",))
    for cls, status in ((NaiveBackend, PASS), (IgnoresLayerSpecs, FAIL)):
        target = resolve_target(cls)
        case = next(c for c in tier_cases(target, "stream", cfg) if c.id == "tiny-local-single-1")
        result = run_case(target, "stream", case, cfg)
        assert result.status == status, result.detail


def test_the_backend_author_page_examples_run():
    """docs/attention-variants.md's python blocks run as written."""
    import re
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "attention-variants.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```$", page, re.S | re.M)
    assert blocks
    for body in blocks:
        exec(compile(body, "docs/attention-variants.md", "exec"), {})


def test_engine_picks_only_backends_that_serve_the_models_variants():
    from kvcore import Engine, EngineConfig
    from kvcore.conformance.models import get_model
    from kvcore.errors import BackendUnavailableError
    from kvcore.hookspecs import hookimpl
    from kvcore.plugins.registry import PluginRegistry

    class NoSoftcap(Textbook):
        name = "no_softcap"
        priority = 100  # would win the automatic choice
        capabilities = BackendCapabilities(
            devices=frozenset({"cpu"}), dtypes=ALL_DTYPES, kv_layouts=("contiguous",),
            prefill_variants=frozenset({"sliding_window"}), decode_variants=frozenset({"sliding_window"}),
        )

    class Plugin:
        @hookimpl
        def kvcore_register_backends(self, register):
            register(NoSoftcap)

    registry = PluginRegistry(load_entrypoints=False)
    registry.register_plugin(Plugin(), name="no-softcap")
    try:
        local = get_model("tiny-local", torch.float32, "cpu").model  # a windowed, soft-capped layer
        plain = get_model("tiny", torch.float32, "cpu").model
        def auto(model):
            return Engine(model, None, EngineConfig(max_model_len=64), registry=registry).prefill_backend.name

        assert (auto(plain), auto(local)) == ("no_softcap", "sdpa")
        with pytest.raises(BackendUnavailableError, match="'no_softcap' cannot run this model here: prefill: no "
                                                          "soft-capping; decode: no soft-capping"):
            Engine(local, None, EngineConfig(backend="no_softcap", max_model_len=64), registry=registry)
        with pytest.raises(BackendUnavailableError, match="'no_softcap' cannot run this model here: decode: no "
                                                          "soft-capping"):
            Engine(local, None, EngineConfig(prefill_backend="naive", decode_backend="no_softcap", max_model_len=64),
                   registry=registry)
    finally:
        registry.unregister_plugin("no-softcap")
