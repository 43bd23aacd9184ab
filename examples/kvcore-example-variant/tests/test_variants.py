"""The package's variants through kvcore's reference backend (naive), its engine and its conformance suite.

naive evaluates any variant as code, so the oracle of a new variant is the variant itself; these tests check
that the variants mean what their docstrings say (against attention written out, and against kvcore's built-in
sliding window), that config selects them, and that ``kvcore conformance`` certifies naive with them and
catches a backend that gets them wrong.
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
import torch
from conftest import random_model
from kvcore_example_variant import Alibi, LocalGlobal

from kvcore import Engine, EngineConfig, SamplingParams, load_settings
from kvcore.backends.naive import NaiveBackend
from kvcore.conformance.results import FAIL, PASS, SKIP
from kvcore.conformance.runner import run_case, tier_cases
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import resolve_target
from kvcore.interfaces.variants import LayerShape
from kvcore.model.layers import bind_variants

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = list(range(3, 40))


def _tokens(model, registry, **config):
    engine = Engine(model, None, EngineConfig(dtype="float32", backend="naive", **config), registry=registry)
    return engine.generate([PROMPT], GREEDY)[0].token_ids


def test_alibi_is_a_per_head_linear_bias_on_distance():
    mod = Alibi(max_bias=8.0).bind(LayerShape(0, 1, num_heads=4, num_kv_heads=2, head_dim=16))
    h, q, kv = torch.arange(4)[:, None, None], torch.arange(5)[None, :, None], torch.arange(5)[None, None, :]
    bias = mod.score_mod(torch.zeros(4, 5, 5), torch.tensor(0), h, q, kv)
    slopes = torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8])  # 2^(-8 (h+1) / 4)
    torch.testing.assert_close(bias, slopes[:, None, None] * (torch.arange(5)[None, :] - torch.arange(5)[:, None]))


def test_local_global_equals_kvcore_s_built_in_windows(registry):
    """local_global(window 8, period 2) on a plain model == the same weights declaring layer 0 windowed."""
    plain = random_model(num_layers=2)
    windowed = random_model(num_layers=2, sliding_window=8, sliding_window_layers=(0,))
    windowed.load_state_dict(plain.state_dict())
    variants = [LocalGlobal(window=8, period=2)]
    bound = bind_variants(plain.attention_layers, variants, num_heads=4, num_kv_heads=2, head_dim=16)
    assert [[m.name for m in a.mods] for a in bound] == [["local_global"], []]
    assert _tokens(plain, registry, attention_variants=("local_global",),
                   variant_options={"local_global": {"window": 8}}) == _tokens(windowed, registry)


def test_alibi_changes_the_stream_and_its_options_matter(registry):
    model = random_model()
    base, alibi = _tokens(model, registry), _tokens(model, registry, attention_variants=("alibi",))
    gentle = _tokens(model, registry, attention_variants=("alibi",), variant_options={"alibi": {"max_bias": 0.5}})
    assert len({tuple(base), tuple(alibi), tuple(gentle)}) == 3


def test_kvcore_toml_selects_alibi_with_its_options():
    engine = load_settings(PACKAGE_ROOT / "kvcore.toml").engine
    assert engine.attention_variants == ("alibi",) and engine.variant_options == {"alibi": {"max_bias": 8.0}}


def test_the_entry_point_registers_both(monkeypatch):
    from kvcore.plugins.registry import PluginRegistry

    declared = tomllib.loads((PACKAGE_ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["kvcore"]
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="kvcore")}
    if installed.get("example_variants") != declared["example_variants"]:
        pytest.skip("the package is not installed: pip install -e examples/kvcore-example-variant")
    monkeypatch.setenv("KVCORE_LOAD_PLUGINS", "example_variants")
    registry = PluginRegistry()
    assert {n: e.plugin for n, e in registry.attention_variants.items()} == {
        "alibi": "example_variants", "local_global": "example_variants"}
    assert not registry.load_warnings


# -- conformance ------------------------------------------------------------------------------------------------

CFG = SuiteConfig(quick=True, dtype="float32", models=("tiny",), attention_variants=("alibi", "local_global"))


class OffByOne(NaiveBackend):
    """Planted: evaluates every mask_mod one query position late (a kernel's off-by-one row index)."""

    name = "planted_off_by_one"

    def forward(self, layer_idx, q, k, v, cache, meta):
        import dataclasses

        from kvcore.interfaces.variants import BoundVariant

        def late(mod):
            if mod.mask_mod is None:
                return mod
            return BoundVariant(mod.name, mod.score_mod, lambda b, h, qi, kv, m=mod.mask_mod: m(b, h, qi - 1, kv))

        layers = tuple(dataclasses.replace(a, mods=tuple(late(m) for m in a.mods)) for a in meta.layers)
        return super().forward(layer_idx, q, k, v, cache, dataclasses.replace(meta, layers=layers))


def _run(backend, registry, tier, select=lambda case: True):
    target = resolve_target(backend, registry)
    return {c.id: run_case(target, tier, c, CFG) for c in tier_cases(target, tier, CFG) if select(c)}


def test_conformance_certifies_naive_with_both_variants(registry):
    op = _run("naive", registry, "op", lambda c: "alibi" in c.id or "local_global" in c.id)
    assert len(op) == 4 and {r.status for r in op.values()} == {PASS}, op
    stream = _run("naive", registry, "stream", lambda c: c.id in ("tiny-single-1", "tiny-batch"))
    assert {r.status for r in stream.values()} == {PASS}, stream


def test_a_backend_that_does_not_evaluate_mods_is_skipped_with_the_reason(registry):
    op = _run("sdpa", registry, "op", lambda c: c.id.endswith("plain+alibi"))
    [result] = op.values()
    assert result.status == SKIP and result.detail == "prefill: no variant 'alibi'; decode: no variant 'alibi'"


def test_a_planted_bug_is_caught_naming_the_variant_and_the_first_differing_token(registry):
    op = _run(OffByOne, registry, "op", lambda c: "local_global" in c.id)
    assert {r.status for r in op.values()} == {FAIL}
    assert all("layer 0 (" in r.detail and "local_global)" in r.detail for r in op.values()), op
    [stream] = _run(OffByOne, registry, "stream", lambda c: c.id == "tiny-single-1").values()
    assert stream.status == FAIL, stream.detail
    assert "model tiny (attention variants alibi, local_global)" in stream.detail
    assert "diverges from the reference at step" in stream.detail, stream.detail


def test_kvcore_conformance_cli_runs_with_the_variant_selected(monkeypatch, capsys):
    """``kvcore conformance --backend naive --attention-variant alibi``: the installed plugin, end to end."""
    from kvcore.cli import main
    from kvcore.plugins.registry import reset_registry

    if "example_variants" not in {ep.name for ep in importlib.metadata.entry_points(group="kvcore")}:
        pytest.skip("the package is not installed: pip install -e examples/kvcore-example-variant")
    monkeypatch.setenv("KVCORE_LOAD_PLUGINS", "example_variants")
    reset_registry()
    try:
        rc = main(["conformance", "--backend", "naive", "--attention-variant", "alibi", "--tier", "op",
                   "--quick", "--dtype", "float32", "--no-progress", "--verbose"])
    finally:
        reset_registry()
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "quick, attention variants alibi, models" in out.splitlines()[0]
    assert "-plain+alibi: pass" in out and "-window13-softcap+alibi: pass" in out
