"""Plugin registry: built-ins through the hooks, third-party plugins, and every registration rule, for each
pluggable kind (backends, KV caches, samplers)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect

import pytest
import torch
from helpers import make_plugin, registered

from kvcore import (
    AttentionBackend,
    BackendCapabilities,
    CacheCapabilities,
    CacheSpec,
    Engine,
    EngineConfig,
    KVCache,
    Sampler,
    SamplingParams,
    hookimpl,
)
from kvcore.backends.contiguous import ContiguousKVCache
from kvcore.backends.paged import PagedKVCache
from kvcore.backends.quantized import Int8KVCache
from kvcore.errors import BackendUnavailableError, ConfigError, PluginError, UnknownBackendError
from kvcore.interfaces.variants import AttentionVariant, BoundVariant
from kvcore.model.families import Llama
from kvcore.plugins.architectures import for_hf_config
from kvcore.plugins.registry import (
    ARCHITECTURE,
    BACKEND,
    BUILTIN_PLUGINS,
    KINDS,
    KV_CACHE,
    PROPOSER,
    SAMPLER,
    VARIANT,
    PluginRegistry,
)
from kvcore.sampling.sampler import DefaultSampler
from kvcore.speculative.ngram import NgramProposer

CAPS = BackendCapabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}), kv_layouts=("contiguous",))
CACHE_CAPS = CacheCapabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}))
SPEC = CacheSpec(1, 2, 8, torch.float32, torch.device("cpu"), 2, 16)


def make_backend(name: str, **attrs):
    from kvcore.backends.sdpa import SDPABackend

    return type(f"B_{name}", (SDPABackend,), {"name": name, **attrs})


def make_cache(name: str, base: type[KVCache] = ContiguousKVCache, **attrs):
    return type(f"C_{name}", (base,), {"name": name, **attrs})


def make_sampler(name: str, **attrs):
    return type(f"S_{name}", (DefaultSampler,), {"name": name, **attrs})


def make_proposer(name: str, **attrs):
    return type(f"P_{name}", (NgramProposer,), {"name": name, **attrs})


class _Variant(AttentionVariant):
    def bind(self, shape):
        return BoundVariant(self.name, mask_mod=lambda b, h, q, kv: q >= kv)


def make_variant(name: str, **attrs):
    return type(f"V_{name}", (_Variant,), {"name": name, **attrs})


def make_architecture(name: str, **attrs):
    hf = (f"{name.capitalize()}ForCausalLM",)
    return type(f"A_{name}", (Llama,), {"name": name, "hf_architectures": hf, "gguf_arch": None, **attrs})


class TaggedCache(ContiguousKVCache):
    """A third-party KV cache with an option (the built-ins' pattern: known options by name, the rest to
    the base class, which rejects them)."""

    name = "tagged"
    description = "contiguous storage that remembers a tag"

    def __init__(self, spec: CacheSpec, tag: str = "untagged", **options) -> None:
        super().__init__(spec, **options)
        self.tag = tag


class RingCache(ContiguousKVCache):
    """A cache in a layout no registered backend reads."""

    name = "ring"
    layout = "ring"


class ConstantSampler(Sampler):
    """Always picks ``token`` (an option)."""

    name = "constant"
    description = "always the same token"

    def __init__(self, token: int = 0, **options) -> None:
        super().__init__(**options)
        self.token = token

    def sample(self, logits, rows):
        return torch.full((logits.shape[0],), self.token, dtype=torch.int64, device=logits.device)


@pytest.fixture
def registry():
    reg = PluginRegistry(load_entrypoints=False)
    reg.backends  # noqa: B018 - load built-ins
    return reg


@pytest.fixture
def with_plugin(registry):
    """Register throwaway plugins; always unregistered afterwards (datasette style)."""
    names = []

    def add(plugin, name):
        names.append(registry.register_plugin(plugin, name=name))
        return registry

    try:
        yield add
    finally:
        for name in names:
            registry.unregister_plugin(name)


# -- built-ins ---------------------------------------------------------------------------------------------
def test_builtins_register_through_the_public_hooks(registry):
    expected = {
        BACKEND: {"naive": "kvcore.backends.naive", "sdpa": "kvcore.backends.sdpa", "paged": "kvcore.backends.paged"},
        KV_CACHE: {
            "contiguous": "kvcore.backends.contiguous",
            "paged": "kvcore.backends.paged",
            "int8": "kvcore.backends.quantized",
            "flash_contiguous": "kvcore.backends.flash_attn2",
        },
        SAMPLER: {"default": "kvcore.sampling.sampler"},
        PROPOSER: {"ngram": "kvcore.speculative.ngram", "draft": "kvcore.speculative.draft"},
    }
    for kind, names in expected.items():
        for name, plugin in names.items():
            entry = registry.get(name, kind)
            assert (entry.plugin, entry.kind) == (plugin, kind) and entry.plugin in BUILTIN_PLUGINS
        impls = {i.plugin_name for i in getattr(registry.pm.hook, kind.hook).get_hookimpls()}
        assert set(names.values()) <= impls
    assert registry.get("default", SAMPLER).cls is DefaultSampler
    assert registry.get("int8", KV_CACHE).cls is Int8KVCache and Int8KVCache.layout == "paged"


# -- third-party plugins -----------------------------------------------------------------------------------
def test_third_party_backend_is_usable(with_plugin):
    reg = with_plugin(make_plugin(backends=[make_backend("mine")]), "my-plugin")
    assert reg.get("mine").plugin == "my-plugin"
    assert reg.create("mine").name == "mine"


def test_third_party_kv_cache_and_sampler_are_selected_by_the_engine(with_plugin, random_model):
    reg = with_plugin(make_plugin(kv_caches=[TaggedCache], samplers=[ConstantSampler]), "my-plugin")
    assert reg.get("tagged", KV_CACHE).plugin == reg.get("constant", SAMPLER).plugin == "my-plugin"
    config = EngineConfig(
        backend="sdpa",
        kv_cache="tagged",
        sampler="constant",
        max_model_len=64,
        kv_cache_options={"tagged": {"tag": "blue"}, "paged": {"block_size": 4}},  # only the chosen table is used
        sampler_options={"constant": {"token": 7}},
    )
    engine = Engine(random_model, None, config, registry=reg)
    assert type(engine.cache) is TaggedCache and engine.cache.tag == "blue"  # the options reached __init__
    assert type(engine.sampler) is ConstantSampler and engine.sampler.token == 7
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    assert engine.generate([[1, 2, 3], [4, 5]], params)[0].token_ids == [7, 7, 7, 7]
    # the third-party cache is real storage: with the default sampler it gives the reference stream
    reference = Engine(random_model, None, EngineConfig(backend="naive", max_model_len=64), registry=reg)
    tagged = Engine(random_model, None, EngineConfig(backend="sdpa", kv_cache="tagged", max_model_len=64), registry=reg)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    want = [r.token_ids for r in reference.generate([[1, 5, 9], list(range(10, 30))], params)]
    assert [r.token_ids for r in tagged.generate([[1, 5, 9], list(range(10, 30))], params)] == want
    assert tagged.cache.tag == "untagged"


def test_throwaway_plugin_is_gone_after_unregistering(registry):
    plugin = make_plugin(backends=[make_backend("mine")], kv_caches=[TaggedCache], samplers=[ConstantSampler])
    with registered(registry, plugin, "my-plugin") as reg:
        assert "mine" in reg.backends and "tagged" in reg.kv_caches and "constant" in reg.samplers
    assert not {"mine", "tagged", "constant"} & {*registry.backends, *registry.kv_caches, *registry.samplers}
    with pytest.raises(ConfigError, match="unknown KV cache 'tagged'"):
        registry.get("tagged", KV_CACHE)
    with pytest.raises(ConfigError, match="unknown sampler 'constant'"):
        registry.get("constant", SAMPLER)


# -- registration rules, for every kind ------------------------------------------------------------------
DUPLICATES = {  # kind: (a class claiming a built-in's name, the built-in's plugin, another built-in of that kind)
    "backend": (BACKEND, lambda: make_backend("sdpa"), "kvcore.backends.sdpa", "naive"),
    "kv_cache": (KV_CACHE, lambda: make_cache("paged", PagedKVCache), "kvcore.backends.paged", "contiguous"),
    "sampler": (SAMPLER, lambda: make_sampler("default"), "kvcore.sampling.sampler", None),
    "proposer": (PROPOSER, lambda: make_proposer("ngram"), "kvcore.speculative.ngram", "draft"),
}


def _plugin_of(kind, *classes, **kw):
    key = {BACKEND: "backends", KV_CACHE: "kv_caches", SAMPLER: "samplers", ARCHITECTURE: "architectures",
           PROPOSER: "proposers", VARIANT: "variants"}[kind]
    return make_plugin(**{key: classes}, **kw)


@pytest.mark.parametrize("kind_key", list(DUPLICATES))
def test_builtin_name_cannot_be_taken_over(with_plugin, kind_key):
    """A third-party plugin registering a built-in's name is refused with a warning naming both plugins;
    the built-in stays (it is never silently replaced or removed)."""
    kind, make, builtin_plugin, other = DUPLICATES[kind_key]
    duplicate = make()
    reg = with_plugin(_plugin_of(kind, duplicate), "evil-plugin")
    with pytest.warns(RuntimeWarning, match=rf"is built in \(plugin '{builtin_plugin}'\); plugin 'evil-plugin'") as rec:
        entry = reg.get(duplicate.name, kind)
    assert len(rec) == 1
    assert entry.plugin == builtin_plugin and entry.cls is not duplicate
    if other is not None:
        assert reg.get(other, kind)  # the others keep working


@pytest.mark.parametrize("kind", KINDS, ids=[k.key for k in KINDS])
def test_duplicate_name_across_third_party_plugins_names_both(with_plugin, random_model, kind):
    makers = {BACKEND: make_backend, KV_CACHE: make_cache, SAMPLER: make_sampler, ARCHITECTURE: make_architecture,
              PROPOSER: make_proposer, VARIANT: make_variant}
    twin = makers[kind]("twin")
    with_plugin(_plugin_of(kind, twin), "plugin-a")
    reg = with_plugin(_plugin_of(kind, twin), "plugin-b")
    with pytest.warns(RuntimeWarning, match="'twin' is registered twice"):
        reg.entries(kind)
    with pytest.raises(PluginError, match=r"by plugin 'plugin-a' and by plugin 'plugin-b'"):
        reg.get("twin", kind)
    # choosing it for an engine (a model) is the same error, never a silent pick of one of them
    if kind is ARCHITECTURE:
        with pytest.raises(PluginError, match=r"by plugin 'plugin-a' and by plugin 'plugin-b'"):
            for_hf_config({"architectures": ["TwinForCausalLM"]}, "m", registry=reg)
        return
    field = {BACKEND: "backend", KV_CACHE: "kv_cache", SAMPLER: "sampler", PROPOSER: "proposer",
             VARIANT: "attention_variants"}[kind]
    with pytest.raises(PluginError, match=r"by plugin 'plugin-a' and by plugin 'plugin-b'"):
        Engine(random_model, None, EngineConfig(**{field: ("twin",) if kind is VARIANT else "twin"}), registry=reg)


@pytest.mark.parametrize("backend, cache_base", [("paged", PagedKVCache), ("sdpa", ContiguousKVCache)])
def test_canonical_cache_of_a_layout_cannot_be_taken_over(with_plugin, random_model, backend, cache_base):
    duplicate = make_cache(cache_base.name, cache_base)
    reg = with_plugin(make_plugin(kv_caches=[duplicate]), "evil-plugin")
    with pytest.warns(RuntimeWarning, match="may not register it again"):
        reg.kv_caches  # noqa: B018
    engine = Engine(random_model, None, EngineConfig(backend=backend), registry=reg)
    assert type(engine.cache) is cache_base


def test_conflict_on_a_third_party_layouts_canonical_cache_is_an_error(with_plugin, random_model):
    """Two third-party plugins both claiming the canonical cache of a new layout: choosing it is an error."""
    twin = make_cache("exotic", PagedKVCache, layout="exotic")
    reader = make_backend("exotic_reader", capabilities=dataclasses.replace(CAPS, kv_layouts=("exotic",)))
    with_plugin(make_plugin(kv_caches=[twin], backends=[reader]), "plugin-a")
    reg = with_plugin(make_plugin(kv_caches=[twin]), "plugin-b")
    with pytest.warns(RuntimeWarning, match="registered twice"):
        reg.kv_caches  # noqa: B018
    with pytest.raises(PluginError, match=r"'exotic' is registered twice.*'plugin-a'.*'plugin-b'"):
        Engine(random_model, None, EngineConfig(backend="exotic_reader"), registry=reg)


INCOMPLETE = {
    "backend": (
        BACKEND,
        lambda: type("Half", (AttentionBackend,), {"name": "half", "capabilities": CAPS}),
        "forward; backend rejected",
        UnknownBackendError,
    ),
    "kv_cache": (
        KV_CACHE,
        lambda: type("Half", (KVCache,), {"name": "half", "layout": "contiguous", "capabilities": CACHE_CAPS}),
        "copy_blocks, kv_bytes_allocated, read, write; KV cache rejected",
        ConfigError,
    ),
    "sampler": (SAMPLER, lambda: type("Half", (Sampler,), {"name": "half"}), "sample; sampler rejected", ConfigError),
}


@pytest.mark.parametrize("kind_key", list(INCOMPLETE))
def test_incomplete_class_rejected_with_missing_names(with_plugin, kind_key):
    kind, make, missing, unknown_error = INCOMPLETE[kind_key]
    with pytest.warns(RuntimeWarning, match=rf"plugin 'half-plugin': .* class Half does not implement: {missing}"):
        reg = with_plugin(_plugin_of(kind, make()), "half-plugin")
        reg.entries(kind)
    with pytest.raises(unknown_error, match="unknown .* 'half'"):
        reg.get("half", kind)


def _complete_cache(name: str, **attrs) -> type[KVCache]:
    """A KVCache subclass implementing every abstract method (as no-ops), plus ``attrs``."""
    body = dict.fromkeys(("write", "copy_blocks", "read"), lambda *args: None)
    return type(f"C_{name}", (KVCache,), {"name": name, **body, "kv_bytes_allocated": property(lambda s: 0), **attrs})


def test_kv_cache_must_declare_its_layout_and_capabilities(with_plugin):
    no_layout = _complete_cache("nolayout", capabilities=CACHE_CAPS)
    no_caps = _complete_cache("nocaps", layout="contiguous")
    complete = _complete_cache("complete", layout="contiguous", capabilities=CACHE_CAPS)
    with pytest.warns(RuntimeWarning) as warned:
        reg = with_plugin(make_plugin(kv_caches=[no_layout, no_caps, complete]), "sloppy-plugin")
        reg.kv_caches  # noqa: B018
    messages = "\n".join(str(w.message) for w in warned)
    assert "plugin 'sloppy-plugin': KV cache 'nolayout' declares no 'layout'; KV cache rejected" in messages
    assert "plugin 'sloppy-plugin': KV cache 'nocaps' declares no 'capabilities'; KV cache rejected" in messages
    assert "complete" in reg.kv_caches and not {"nolayout", "nocaps"} & set(reg.kv_caches)


@pytest.mark.parametrize("kind", KINDS, ids=[k.key for k in KINDS])
def test_not_a_subclass_rejected(with_plugin, kind):
    with pytest.warns(RuntimeWarning, match=rf"which is not a subclass of {kind.base.__name__}"):
        reg = with_plugin(_plugin_of(kind, dict), "dict-plugin")
        reg.entries(kind)
    assert "naive" in reg.backends and "contiguous" in reg.kv_caches and "default" in reg.samplers


@pytest.mark.parametrize("kind", KINDS, ids=[k.key for k in KINDS])
def test_raising_hook_is_named_and_others_survive(with_plugin, kind):
    with pytest.warns(RuntimeWarning, match=f"plugin 'broken' raised in {kind.hook}"):
        reg = with_plugin(make_plugin(raises=RuntimeError("boom"), raise_in=kind.hook), "broken")
        reg.entries(kind)
    assert {"naive", "sdpa"} <= set(reg.backends)
    assert {"contiguous", "paged"} <= set(reg.kv_caches) and "default" in reg.samplers


def test_unknown_names_suggest_close_ones(registry):
    with pytest.raises(UnknownBackendError, match=r"unknown backend 'sdap'.*did you mean 'sdpa'"):
        registry.get("sdap")
    with pytest.raises(ConfigError, match=r"unknown KV cache 'pagd'.*did you mean 'paged'"):
        registry.get("pagd", KV_CACHE)
    with pytest.raises(ConfigError, match=r"unknown sampler 'defualt'.*did you mean 'default'"):
        registry.get("defualt", SAMPLER)


def test_unavailable_backend_reports_reason(with_plugin):
    cls = make_backend("never", availability=classmethod(lambda cls: "needs a quantum computer"))
    reg = with_plugin(make_plugin(backends=[cls]), "never-plugin")
    with pytest.raises(BackendUnavailableError, match="backend 'never' is unavailable: needs a quantum computer"):
        reg.create("never")
    assert reg.get("never") not in reg.available()


def test_unavailable_kv_cache_and_sampler_report_reasons(with_plugin, random_model):
    never = classmethod(lambda cls: "needs a quantum computer")
    plugin = make_plugin(
        kv_caches=[make_cache("qcache", availability=never), make_cache("fp64only", capabilities=CacheCapabilities(
            devices=frozenset({"cpu"}), dtypes=frozenset({torch.float64})))],
        samplers=[make_sampler("qsampler", availability=never)],
    )
    reg = with_plugin(plugin, "never-plugin")
    with pytest.raises(BackendUnavailableError, match="KV cache 'qcache' is unavailable: needs a quantum computer"):
        reg.create_cache("qcache", SPEC)
    with pytest.raises(BackendUnavailableError, match=r"KV cache 'fp64only' cannot hold .*dtype float32 not supp"):
        reg.create_cache("fp64only", SPEC)
    with pytest.raises(BackendUnavailableError, match="sampler 'qsampler' is unavailable: needs a quantum computer"):
        reg.create_sampler("qsampler")
    for name in ("qcache", "fp64only"):  # the engine says why too
        with pytest.raises(BackendUnavailableError, match=f"'{name}': (needs a quantum computer|dtype float32)"):
            Engine(random_model, None, EngineConfig(backend="sdpa", kv_cache=name), registry=reg)


# -- selection by the engine -----------------------------------------------------------------------------
def test_cache_layout_the_backend_cannot_read_is_refused(with_plugin, random_model):
    reg = with_plugin(make_plugin(kv_caches=[RingCache]), "ring-plugin")
    for backend in ("sdpa", "naive", "paged"):
        with pytest.raises(ConfigError, match=rf"KV cache 'ring' has layout 'ring', which backend '{backend}' cannot"):
            Engine(random_model, None, EngineConfig(backend=backend, kv_cache="ring"), registry=reg)
    with pytest.raises(ConfigError, match=r"KV cache 'int8' has layout 'paged', which backend 'sdpa' cannot read"):
        Engine(random_model, None, EngineConfig(backend="sdpa", kv_cache="int8"), registry=reg)
    split = EngineConfig(prefill_backend="naive", decode_backend="sdpa", kv_cache="paged")
    with pytest.raises(ConfigError, match=r"layout 'paged', which backends 'naive' and 'sdpa' cannot read"):
        Engine(random_model, None, split, registry=reg)
    # with no backend named, none reads it: the error names the cache
    with pytest.raises(BackendUnavailableError, match="no registered backend that reads the 'ring' KV cache"):
        Engine(random_model, None, EngineConfig(kv_cache="ring"), registry=reg)


def test_auto_selection_for_the_int8_cache_picks_a_paged_reader(registry, random_model):
    engine = Engine(random_model, None, EngineConfig(kv_cache="int8", max_model_len=64), registry=registry)
    for backend in (engine.prefill_backend, engine.decode_backend):
        assert "paged" in backend.capabilities.kv_layouts and backend.availability() is None
    assert type(engine.cache) is Int8KVCache
    res = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert len(res.token_ids) == 4 and engine.cache.k_pool.dtype == torch.int8


def test_backend_options_reach_constructor_and_unknown_ones_fail(with_plugin):
    class WithOpts(make_backend("opts")):
        def __init__(self, window: int = 4, **options):
            super().__init__(**options)
            self.window = window

    reg = with_plugin(make_plugin(backends=[WithOpts]), "opts-plugin")
    assert reg.create("opts", {"window": 9}).window == 9
    with pytest.raises(ConfigError, match="got unknown options"):
        reg.create("sdpa", {"window": 9})
    with pytest.raises(ConfigError, match="got unknown options: size"):
        reg.create("opts", {"window": 9, "size": 1})


def test_kv_cache_and_sampler_options_reach_constructors_and_unknown_ones_fail(with_plugin, random_model):
    reg = with_plugin(make_plugin(kv_caches=[TaggedCache], samplers=[ConstantSampler]), "opts-plugin")
    assert reg.create_cache("tagged", SPEC, {"tag": "red"}).tag == "red"
    assert reg.create_sampler("constant", {"token": 3}).token == 3
    engine = Engine(
        random_model, None, EngineConfig(kv_cache="paged", kv_cache_options={"paged": {"block_size": 8}}), registry=reg
    )
    assert engine.cache.block_size == 8 and engine.kv.blocks.block_size == 8  # a built-in cache's option
    bad = [
        ("KV cache 'tagged'.*colour", dict(kv_cache="tagged", kv_cache_options={"tagged": {"colour": 1}})),
        ("KV cache 'paged'.*blocksize", dict(kv_cache="paged", kv_cache_options={"paged": {"blocksize": 8}})),
        ("sampler 'constant'.*tokn", dict(sampler="constant", sampler_options={"constant": {"tokn": 3}})),
        ("sampler 'default'.*colour", dict(sampler_options={"default": {"colour": "red"}})),
    ]
    for match, cfg in bad:
        with pytest.raises(ConfigError, match=match):
            Engine(random_model, None, EngineConfig(**cfg), registry=reg)


class _StrictBackend(make_backend("strict")):
    def __init__(self, window: int = 4):
        self.window = window


class _StrictCache(ContiguousKVCache):
    name = "strict"

    def __init__(self, spec, tag: str = ""):
        super().__init__(spec)


class _StrictSampler(ConstantSampler):
    name = "strict"

    def __init__(self, token: int = 0):
        self.token = token


class _StrictProposer(NgramProposer):
    name = "strict"

    def __init__(self, max_n: int = 3):
        super().__init__(max_n=max_n)


class _StrictVariant(_Variant):
    name = "strict"

    def __init__(self, slope: float = 1.0):
        self.slope = slope


CONSTRUCTED = [k for k in KINDS if k is not ARCHITECTURE]  # architectures are declarations: no instances


@pytest.mark.parametrize("kind", CONSTRUCTED, ids=[k.key for k in CONSTRUCTED])
def test_unknown_option_of_a_class_with_named_keywords_is_a_config_error(with_plugin, kind):
    cls = {BACKEND: _StrictBackend, KV_CACHE: _StrictCache, SAMPLER: _StrictSampler, PROPOSER: _StrictProposer,
           VARIANT: _StrictVariant}[kind]
    reg = with_plugin(_plugin_of(kind, cls), "strict-plugin")
    create = {
        BACKEND: lambda opts: reg.create("strict", opts),
        KV_CACHE: lambda opts: reg.create_cache("strict", SPEC, opts),
        SAMPLER: lambda opts: reg.create_sampler("strict", opts),
        PROPOSER: lambda opts: reg.create_proposer("strict", opts),
        VARIANT: lambda opts: reg.create_variant("strict", opts),
    }[kind]
    with pytest.raises(ConfigError, match="'strict'.*wrong_name"):
        create({"wrong_name": 1})


def test_plugin_receives_its_own_config_table(with_plugin):
    received = {}
    plugin = make_plugin(backends=[make_backend("cfg")])

    @hookimpl
    def kvcore_configure(options):
        received.update(options)

    plugin.kvcore_configure = kvcore_configure
    reg = with_plugin(plugin, "cfg-plugin")
    reg.configure({"cfg-plugin": {"level": 3}})
    assert received == {"level": 3}
    with pytest.raises(ConfigError, match=r"\[plugins.nope\] names no loaded plugin"):
        reg.configure({"nope": {}})


# -- discovery ---------------------------------------------------------------------------------------------
class FakeEntryPoint:
    def __init__(self, name, obj=None, error=None):
        self.name, self._obj, self._error = name, obj, error

    def load(self):
        if self._error:
            raise self._error
        return self._obj


def test_entry_points_allowlist_and_import_failure(monkeypatch):
    good = make_plugin(backends=[make_backend("good")], kv_caches=[TaggedCache], samplers=[ConstantSampler])
    other = make_plugin(backends=[make_backend("other")])
    eps = [
        FakeEntryPoint("good-plugin", good),
        FakeEntryPoint("other-plugin", other),
        FakeEntryPoint("bad-plugin", error=ImportError("no module named 'missing_dep'")),
    ]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: eps if group == "kvcore" else [])

    monkeypatch.delenv("KVCORE_LOAD_PLUGINS", raising=False)
    with pytest.warns(RuntimeWarning, match="plugin 'bad-plugin' failed to load"):
        reg = PluginRegistry()
        names = set(reg.backends)
    assert {"good", "other", "naive"} <= names
    assert reg.get("tagged", KV_CACHE).plugin == reg.get("constant", SAMPLER).plugin == "good-plugin"

    monkeypatch.setenv("KVCORE_LOAD_PLUGINS", "good-plugin")
    assert {"good", "naive"} <= set(PluginRegistry().backends)
    assert "other" not in PluginRegistry().backends

    monkeypatch.setenv("KVCORE_LOAD_PLUGINS", "")
    empty = PluginRegistry()
    assert not {"good", "other"} & set(empty.backends)
    assert "tagged" not in empty.kv_caches and "constant" not in empty.samplers


def test_plugins_load_lazily():
    reg = PluginRegistry(load_entrypoints=False)
    assert reg.pm.get_plugins() == set()
    reg.get("naive")
    assert reg.pm.get_plugins()


def test_hooks_are_documented_in_readme():
    """Every hookspec appears in README.md with its signature, e.g. `kvcore_register_backends(register)`."""
    from pathlib import Path

    from kvcore import hookspecs

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    # what HookspecMarker("kvcore") marks, and so what the plugin manager knows
    specs = {name: fn for name, fn in vars(hookspecs).items() if callable(fn) and hasattr(fn, "kvcore_spec")}
    known = {name for name in dir(PluginRegistry(load_entrypoints=False).pm.hook) if name.startswith("kvcore_")}
    assert set(specs) == known
    assert {"kvcore_register_backends", "kvcore_register_kv_caches", "kvcore_register_samplers"} <= set(specs)
    assert {kind.hook for kind in KINDS} <= set(specs)
    missing = []
    for name, fn in sorted(specs.items()):
        assert name in hookspecs.__all__ and inspect.getdoc(fn), f"hook {name} is not exported or has no docstring"
        signature = f"{name}({', '.join(inspect.signature(fn).parameters)})"
        if f"`{signature}`" not in readme:
            missing.append(signature)
    assert not missing, f"hooks not documented in README.md (as `name(args)`): {', '.join(missing)}"


def test_backend_refuses_unsupported_dtype_and_head_size(with_plugin, random_model):
    narrow = make_backend(
        "narrow",
        capabilities=BackendCapabilities(
            devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}), kv_layouts=("contiguous",),
            head_dims=frozenset({64, 128}),
        ),
    )
    reg = with_plugin(make_plugin(backends=[narrow]), "narrow-plugin")
    with pytest.raises(BackendUnavailableError, match=r"cannot run this model here: head_dim 16 not supported"):
        Engine(random_model, None, EngineConfig(backend="narrow"), registry=reg)
    bf16 = random_model.to(torch.bfloat16)
    try:
        with pytest.raises(BackendUnavailableError, match=r"dtype bfloat16 not supported \(supports: float32\)"):
            Engine(bf16, None, EngineConfig(backend="narrow", dtype="bfloat16"), registry=reg)
    finally:
        random_model.to(torch.float32)


def test_readme_support_table_is_generated_from_declarations(registry):
    from pathlib import Path

    from kvcore.plugins.support import backend_rows, markdown_table

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    start, end = "<!-- backends-table:start -->\n", "\n<!-- backends-table:end -->"
    documented = readme[readme.index(start) + len(start) : readme.index(end)]
    builtin_rows = [r for r in backend_rows(registry) if r["plugin"] in BUILTIN_PLUGINS]
    assert documented == markdown_table(builtin_rows), "run `kvcore backends --markdown` and update README.md"
