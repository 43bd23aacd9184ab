"""The op tier's attention-variant dimension (kvcore/conformance/attention_cases.py): the built-in backends
pass it, a backend not declaring a variant skips with the reason, and planted bugs in windows, soft-caps
and sinks are caught."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcore.backends.contiguous import ALL_DTYPES
from kvcore.backends.naive import NaiveBackend
from kvcore.conformance.attention_cases import PATTERNS, variant_cases
from kvcore.conformance.cases import BLOCK_SIZE
from kvcore.conformance.results import FAIL, PASS, SKIP
from kvcore.conformance.runner import run_case, tier_cases
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import resolve_target
from kvcore.interfaces.attention import BackendCapabilities, causal_mask
from kvcore.interfaces.layer_attention import VARIANTS

CFG = SuiteConfig(quick=True, dtype="float32")


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
            mask = causal_mask(ctx, n, q.device, layer.sliding_window)
            if layer.sliding_window is not None and self.bug == "window_off_by_one_at_block_boundary":
                first = torch.arange(ctx, seq_len)[:, None] - layer.sliding_window + 1  # first key in the window
                at_boundary = first % BLOCK_SIZE == 0  # a kernel's 16-key block (a contiguous cache has none)
                mask = mask | (at_boundary & (torch.arange(seq_len)[None, :] == first - 1))  # one key too many
            if layer.softcap is not None and self.bug != "softcap_after_mask":
                S = torch.tanh(S / layer.softcap) * layer.softcap
            S = S.masked_fill(~mask, float("-inf"))
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
    target = resolve_target(cls)
    return {c.pattern: run_case(target, "op", c, CFG).status for c in variant_cases(target.cache_names())}


def test_variant_cases_are_in_the_op_tier():
    ids = {c.id for c in tier_cases(resolve_target("naive"), "op", CFG)}
    assert {c.id for c in variant_cases()} <= ids
    assert set(PATTERNS) == {c.pattern for c in variant_cases()}  # every pattern has a row


def test_the_correct_textbook_passes_every_pattern():
    assert set(_results(planted(None)).values()) == {PASS}


@pytest.mark.parametrize("bug, caught", [
    ("window_off_by_one_at_block_boundary",
     {"window16", "window7", "window20", "window13-softcap", "window1", "mixed"}),
    ("softcap_after_mask", {"softcap", "window13-softcap", "mixed"}),
    ("sink_dropped_in_decode", {"sinks", "mixed"}),
])
def test_planted_variant_bugs_are_caught(bug, caught):
    results = _results(planted(bug))
    failed = {p for p, status in results.items() if status == FAIL}
    assert failed and failed <= caught, results  # caught, and only where the bug acts


def test_a_backend_not_declaring_a_variant_is_skipped_with_the_reason():
    class WindowsOnly(Textbook):
        name = "windows_only"
        capabilities = BackendCapabilities(
            devices=frozenset({"cpu"}), dtypes=ALL_DTYPES, kv_layouts=("contiguous",),
            prefill_variants=frozenset(VARIANTS), decode_variants=frozenset({"sliding_window"}),
        )

    target = resolve_target(WindowsOnly)
    by_pattern = {c.pattern: run_case(target, "op", c, CFG) for c in variant_cases(target.cache_names())}
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

    page = (Path(__file__).parents[1] / "docs" / "attention-variants.md").read_text(encoding="utf-8")
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
