"""Attention variants as code (kvcore/interfaces/variants.py): the registry kind, selection by config, binding per
layer, the naive reference's dense evaluation, and the refusal of every backend that does not evaluate them."""

from __future__ import annotations

import pytest
import torch
from helpers import make_plugin, make_random_model, registered

from kvcore import Engine, EngineConfig, SamplingParams, load_settings
from kvcore.backends.contiguous import ContiguousKVCache
from kvcore.backends.naive import NaiveBackend
from kvcore.errors import BackendOutputError, BackendUnavailableError, ConfigError, PluginError
from kvcore.interfaces.kv_cache import CacheSpec
from kvcore.interfaces.layer_attention import LayerAttention
from kvcore.interfaces.variants import AttentionVariant, BoundVariant
from kvcore.plugins.registry import BUILTIN_PLUGINS, VARIANT, PluginRegistry
from kvcore.plugins.support import plugin_rows
from kvcore.scheduling.kv_manager import KVCacheManager

#: built-in backends that evaluate score_mod / mask_mod (flex: the compiled FlexAttention backend, where present)
EVALUATE_MODS = {"naive", "flex"}


class Alibi(AttentionVariant):
    """ALiBi: score + slope_h · (kv − q), the slopes a geometric sequence over the heads."""

    name = "alibi"
    description = "ALiBi linear position biases"
    shapes: list = []  # every LayerShape bound, for the binding test

    def __init__(self, max_bias: float = 8.0) -> None:
        self.max_bias = max_bias

    def bind(self, shape):
        Alibi.shapes.append(shape)
        slopes = torch.tensor([2.0 ** (-self.max_bias * (h + 1) / shape.num_heads) for h in range(shape.num_heads)])
        return BoundVariant(self.name, score_mod=lambda s, b, h, q, kv: s + slopes.to(s.device)[h] * (kv - q))


class EveryOther(AttentionVariant):
    """A mask on odd layers only: a query sees the keys an even distance back."""

    name = "every-other"

    def bind(self, shape):
        if shape.layer_idx % 2 == 0:
            return None
        return BoundVariant(self.name, mask_mod=lambda b, h, q, kv: (q - kv) % 2 == 0)


@pytest.fixture
def registry():
    reg = PluginRegistry(load_entrypoints=False)
    with registered(reg, make_plugin(variants=[Alibi, EveryOther]), "variants-plugin"):
        yield reg


def _naive(layer: LayerAttention, q, k, v):
    """naive's output for one prefill of ``q [n, H, D]``, ``k, v [n, H_kv, D]`` through one layer."""
    n, _, H_kv, D = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    spec = CacheSpec(num_layers=1, num_kv_heads=H_kv, head_dim=D, dtype=torch.float32, device=torch.device("cpu"),
                     max_num_seqs=1, max_seq_len=n + 4, block_size=16)
    kv = KVCacheManager(ContiguousKVCache(spec))
    kv.add_sequence(0)
    meta = kv.prepare([0], [n], layer.scale, [layer])
    return NaiveBackend().forward(0, q, k, v, kv.cache, meta)


def _qkv(n=9, H=4, H_kv=2, D=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, H, D, generator=gen), torch.randn(n, H_kv, D, generator=gen),
            torch.randn(n, H_kv, D, generator=gen))


# -- registry and listing -----------------------------------------------------------------------------------


def test_registered_variants_are_listed_with_the_backends_that_serve_them(registry):
    rows = {r["attention_variant"]: r for r in plugin_rows(registry)["attention_variants"]}
    assert set(rows) == {"alibi", "every-other"}
    assert rows["alibi"]["plugin"] == "variants-plugin"
    assert rows["alibi"]["description"] == "ALiBi linear position biases"
    assert rows["alibi"]["backends"].split(",") == sorted(
        n for n, e in registry.backends.items() if e.cls.capabilities.variants_as_code)


def test_unknown_variant_is_a_config_error_with_a_suggestion(registry):
    with pytest.raises(ConfigError, match="unknown attention variant 'alibl'.*did you mean 'alibi'"):
        registry.get("alibl", VARIANT)


def test_a_variant_may_not_take_a_built_in_variant_name():
    class Window(EveryOther):
        name = "sliding_window"

    reg = PluginRegistry(load_entrypoints=False)
    with registered(reg, make_plugin(variants=[Window]), "bad"), pytest.warns(RuntimeWarning, match="built-in"):
        assert "sliding_window" not in reg.attention_variants


# -- selection ------------------------------------------------------------------------------------------------


def test_toml_selects_variants_and_their_options(tmp_path):
    path = tmp_path / "kvcore.toml"
    path.write_text('attention_variants = ["alibi", "every-other"]\n[variants.alibi]\nmax_bias = 4.0\n')
    engine = load_settings(path).engine
    assert engine.attention_variants == ("alibi", "every-other")
    assert engine.variant_options == {"alibi": {"max_bias": 4.0}}


def test_cli_flag_is_repeatable():
    from kvcore.cli.parser import build_parser
    from kvcore.cli.settings import resolve_settings

    args = build_parser().parse_args(["generate", "hi", "--attention-variant", "alibi", "--attention-variant", "x"])
    assert resolve_settings(args)["attention_variants"] == ["alibi", "x"]


@pytest.mark.parametrize("names", ["alibi", ("alibi", "alibi"), ("",)])
def test_bad_selections_are_config_errors(names):
    with pytest.raises(ConfigError, match="attention_variants"):
        EngineConfig(attention_variants=names)


def test_unknown_option_names_the_variants_table(registry):
    model = make_random_model()
    config = EngineConfig(dtype="float32", attention_variants=("alibi",), variant_options={"alibi": {"bias": 1}})
    with pytest.raises(ConfigError, match=r"\[variants\.alibi\]"):
        Engine(model, None, config, registry=registry)


# -- binding and backend selection ----------------------------------------------------------------------------


def test_engine_binds_each_variant_per_layer_and_leaves_the_model_alone(registry):
    model = make_random_model(num_layers=3)
    Alibi.shapes.clear()
    engine = Engine(model, None, EngineConfig(dtype="float32", attention_variants=("alibi", "every-other")),
                    registry=registry)
    assert [s.layer_idx for s in Alibi.shapes] == [0, 1, 2]
    assert {(s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) for s in Alibi.shapes} == {(3, 4, 2, 16)}
    assert [[m.name for m in a.mods] for a in engine.attention_layers] == [
        ["alibi"], ["alibi", "every-other"], ["alibi"]]
    assert all(not a.mods for a in model.attention_layers)  # another engine over this model may select others
    assert engine.prefill_backend.capabilities.variants_as_code  # auto-selection skips the backends that cannot


@pytest.mark.parametrize("backend", ["sdpa", "paged", "cpu_decode"])
def test_backends_that_do_not_evaluate_mods_are_refused(registry, backend):
    config = EngineConfig(dtype="float32", backend=backend, attention_variants=("alibi",))
    with pytest.raises(BackendUnavailableError, match="decode: no variant 'alibi'"):
        Engine(make_random_model(), None, config, registry=registry)


def test_no_built_in_backend_but_the_evaluators_claims_variants_as_code():
    """A backend that does not evaluate mods must say so through its capabilities, or it would silently
    attend without them."""
    reg = PluginRegistry(load_entrypoints=False)
    backends = {n: e for n, e in reg.backends.items() if e.plugin in BUILTIN_PLUGINS}
    assert {"sdpa", "paged", "cpu_decode", "flash_attn2", "xformers"} <= set(backends)
    for name, entry in backends.items():
        caps = entry.cls.capabilities
        assert caps.variants_as_code == (name in EVALUATE_MODS), name
        if name not in EVALUATE_MODS:
            assert caps.reasons_variants(["alibi"]) == ["prefill: no variant 'alibi'", "decode: no variant 'alibi'"]


def test_variants_refuse_tensor_parallelism(registry):
    config = EngineConfig(dtype="float32", attention_variants=("alibi",), tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        Engine(make_random_model(), None, config, registry=registry)


def test_a_bind_that_raises_is_a_plugin_error_naming_the_variant(registry):
    class Broken(EveryOther):
        name = "broken"

        def bind(self, shape):
            raise RuntimeError("no slopes")

    with registered(registry, make_plugin(variants=[Broken]), "broken-plugin"):
        with pytest.raises(PluginError, match="attention variant 'broken' failed to bind layer 0"):
            Engine(make_random_model(), None, EngineConfig(dtype="float32", attention_variants=("broken",)),
                   registry=registry)


def test_prefix_cache_keys_name_the_variant_selection(registry):
    model = make_random_model()

    def namespace(**kw):
        config = EngineConfig(dtype="float32", backend="naive", enable_prefix_caching=True, **kw)
        return Engine(model, None, config, registry=registry).kv.blocks.namespace

    plain, alibi = namespace(), namespace(attention_variants=("alibi",))
    other = namespace(attention_variants=("alibi",), variant_options={"alibi": {"max_bias": 2.0}})
    assert len({plain, alibi, other}) == 3


def test_the_stream_changes_with_the_variant(registry):
    model = make_random_model()
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)

    def tokens(*names):
        config = EngineConfig(dtype="float32", backend="naive", attention_variants=names)
        return Engine(model, None, config, registry=registry).generate([list(range(3, 40))], params)[0].token_ids

    assert tokens("alibi") != tokens()


def test_the_output_guard_catches_a_backend_that_claims_mods_but_ignores_them(registry):
    """The engine's reference check of layer 0 evaluates the mods too."""
    from dataclasses import replace

    class Ignoring(NaiveBackend):
        name = "ignoring"
        capabilities = NaiveBackend.capabilities

        def forward(self, layer_idx, q, k, v, cache, meta):
            layers = tuple(replace(a, mods=()) for a in meta.layers)
            return super().forward(layer_idx, q, k, v, cache, replace(meta, layers=layers))

    with registered(registry, make_plugin(backends=[Ignoring]), "ignoring-plugin"):
        config = EngineConfig(dtype="float32", backend="ignoring", attention_variants=("alibi",))
        engine = Engine(make_random_model(), None, config, registry=registry)
        [result] = engine.generate([list(range(3, 40))], SamplingParams(max_new_tokens=2))
        assert isinstance(result.error, BackendOutputError)


# -- naive: the dense evaluation ------------------------------------------------------------------------------


def test_naive_adds_the_score_mod_to_the_soft_capped_scores():
    q, k, v = _qkv()
    bias = torch.randn(4, 9, 9, generator=torch.Generator().manual_seed(1))  # [H, q, kv], any function of them
    mod = BoundVariant("bias", score_mod=lambda s, b, h, qi, kv: s * 2 + bias[h, qi, kv])
    out = _naive(LayerAttention(0.3, softcap=1.5, mods=(mod,)), q, k, v)
    # written out: soft-cap first, then the mod, then the causal mask
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    S = torch.tanh(torch.einsum("qhd,khd->hqk", q, kk) * 0.3 / 1.5) * 1.5 * 2 + bias
    S = S.masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(out, torch.einsum("hqk,khd->qhd", S.softmax(-1), vv))


def test_naive_mask_mod_equals_the_built_in_window():
    q, k, v = _qkv(n=13)
    window = BoundVariant("window-as-code", mask_mod=lambda b, h, qi, kv: qi - kv < 4)
    torch.testing.assert_close(_naive(LayerAttention(0.3, mods=(window,)), q, k, v),
                               _naive(LayerAttention(0.3, sliding_window=4), q, k, v), rtol=0, atol=0)


def test_naive_mask_mod_cannot_reveal_a_future_key():
    q, k, v = _qkv()
    everything = BoundVariant("all", mask_mod=lambda b, h, qi, kv: torch.ones_like(qi - kv, dtype=torch.bool))
    torch.testing.assert_close(_naive(LayerAttention(0.3, mods=(everything,)), q, k, v),
                               _naive(LayerAttention(0.3), q, k, v), rtol=0, atol=0)


def test_the_output_guard_reference_evaluates_mods_as_naive_does():
    """The engine's reference check (kvcore/execution/backend_check.py) must mean what naive means, or it
    would fail every correct backend on a variant (or pass a wrong one)."""
    from kvcore.execution.backend_check import reference_attention

    q, k, v = _qkv(n=11)
    mod = BoundVariant("m", score_mod=lambda s, b, h, qi, kv: 2 * torch.tanh(s / 2) - 0.3 * (h + 1) * (qi - kv),
                       mask_mod=lambda b, h, qi, kv: (qi - kv) % 3 != 1)
    layer = LayerAttention(0.3, mods=(mod,))
    # the last 4 queries after 7 cached keys, as the guard checks a continued prefill
    torch.testing.assert_close(reference_attention(q[7:], k, v, 7, layer), _naive(layer, q, k, v)[7:])


def test_serving_config_and_banner_name_the_selection(registry):
    from kvcore.serving.server import banner

    config = EngineConfig(dtype="float32", attention_variants=("alibi", "every-other"))
    serving = Engine(make_random_model(), None, config, registry=registry).serving_config()
    assert serving["attention_variants"] == ["alibi", "every-other"]
    assert banner(serving).endswith(", attention variants alibi, every-other")


def test_options_under_the_selection_key_point_to_the_variants_table(tmp_path):
    """TOML cannot hold ``attention_variants = [...]`` and ``[attention_variants.x]`` together: options live in
    ``[variants.x]``, and a file that puts them under the key is told so."""
    from kvcore.engine.file_config import load_config

    path = tmp_path / "kvcore.toml"
    path.write_text("[attention_variants.alibi]\nmax_bias = 2.0\n")
    with pytest.raises(ConfigError, match=r"unknown section \[attention_variants\.alibi\]; did you mean 'variants'"):
        load_config(path)


def test_speculative_verification_attends_with_the_variants(registry):
    """The verify forward reads the engine's layers too: with (random, mostly rejected) drafts the stream is the
    one without, whose every token the verify forward then computes."""
    from kvcore.conformance.speculative_proposers import RANDOM, plugin

    model = make_random_model()

    def tokens(**kw):
        config = EngineConfig(dtype="float32", backend="naive", attention_variants=("alibi",), **kw)
        engine = Engine(model, None, config, registry=registry)
        out = engine.generate([list(range(3, 30))], SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
        return out[0].token_ids, engine.stats

    plain, _ = tokens()
    with registered(registry, plugin(), "conformance-proposers"):
        speculated, stats = tokens(proposer=RANDOM)
    assert speculated == plain
    assert stats.num_draft_tokens > 0  # drafts were scored under the variant
