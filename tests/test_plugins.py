"""Plugin registry: built-ins through the hook, third-party plugins, and every registration rule."""

from __future__ import annotations

import importlib.metadata
import types

import pytest
import torch

from kvcore import AttentionBackend, BackendCapabilities, hookimpl
from kvcore.errors import BackendUnavailableError, ConfigError, PluginError, UnknownBackendError
from kvcore.plugins import BUILTIN_PLUGINS, BackendRegistry

CAPS = BackendCapabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}), cache_kinds=("contiguous",))


def make_backend(name: str, **attrs):
    from kvcore.backends.sdpa import SDPABackend

    return type(f"B_{name}", (SDPABackend,), {"name": name, **attrs})


def plugin_registering(*classes, raises: Exception | None = None):
    module = types.ModuleType("throwaway_plugin")

    @hookimpl
    def kvcore_register_backends(register):
        if raises:
            raise raises
        for cls in classes:
            register(cls)

    module.kvcore_register_backends = kvcore_register_backends
    return module


@pytest.fixture
def registry():
    reg = BackendRegistry(load_entrypoints=False)
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


def test_builtins_register_through_the_public_hook(registry):
    for name in ("naive", "sdpa"):
        entry = registry.get(name)
        assert entry.plugin.startswith("kvcore.backends.")
        assert entry.plugin in BUILTIN_PLUGINS
    impls = {i.plugin_name for i in registry.pm.hook.kvcore_register_backends.get_hookimpls()}
    assert {"kvcore.backends.naive", "kvcore.backends.sdpa"} <= impls


def test_third_party_backend_is_usable(with_plugin):
    reg = with_plugin(plugin_registering(make_backend("mine")), "my-plugin")
    assert reg.get("mine").plugin == "my-plugin"
    assert reg.create("mine").name == "mine"


def test_duplicate_name_names_both_plugins(with_plugin):
    reg = with_plugin(plugin_registering(make_backend("sdpa")), "evil-plugin")
    with pytest.raises(PluginError) as err, pytest.warns(RuntimeWarning):
        reg.get("sdpa")
    assert "'kvcore.backends.sdpa'" in str(err.value) and "'evil-plugin'" in str(err.value)
    assert reg.get("naive")  # others keep working


def test_incomplete_backend_class_rejected_with_missing_names(with_plugin):
    incomplete = type("Half", (AttentionBackend,), {"name": "half", "capabilities": CAPS})
    with pytest.warns(RuntimeWarning, match=r"does not implement: forward; backend rejected"):
        reg = with_plugin(plugin_registering(incomplete), "half-plugin")
        reg.backends  # noqa: B018
    with pytest.raises(UnknownBackendError):
        reg.get("half")


def test_not_a_backend_class_rejected(with_plugin):
    with pytest.warns(RuntimeWarning, match="not an AttentionBackend subclass"):
        reg = with_plugin(plugin_registering(dict), "dict-plugin")
        reg.backends  # noqa: B018
    assert "naive" in reg.backends


def test_raising_hook_is_named_and_others_survive(with_plugin):
    with pytest.warns(RuntimeWarning, match="plugin 'broken' raised in kvcore_register_backends"):
        reg = with_plugin(plugin_registering(raises=RuntimeError("boom")), "broken")
        reg.backends  # noqa: B018
    assert {"naive", "sdpa"} <= set(reg.backends)


def test_unknown_backend_suggests_close_names(registry):
    with pytest.raises(UnknownBackendError, match=r"unknown backend 'sdap'.*did you mean 'sdpa'"):
        registry.get("sdap")


def test_unavailable_backend_reports_reason(with_plugin):
    cls = make_backend("never", availability=classmethod(lambda cls: "needs a quantum computer"))
    reg = with_plugin(plugin_registering(cls), "never-plugin")
    with pytest.raises(BackendUnavailableError, match="backend 'never' is unavailable: needs a quantum computer"):
        reg.create("never")
    assert reg.get("never") not in reg.available()


def test_backend_options_reach_constructor_and_unknown_ones_fail(with_plugin):
    class WithOpts(make_backend("opts")):
        def __init__(self, window: int = 4):
            self.window = window

    reg = with_plugin(plugin_registering(WithOpts), "opts-plugin")
    assert reg.create("opts", {"window": 9}).window == 9
    with pytest.raises(ConfigError, match="takes no options"):
        reg.create("sdpa", {"window": 9})


def test_plugin_receives_its_own_config_table(with_plugin):
    received = {}
    plugin = plugin_registering(make_backend("cfg"))

    @hookimpl
    def kvcore_configure(options):
        received.update(options)

    plugin.kvcore_configure = kvcore_configure
    reg = with_plugin(plugin, "cfg-plugin")
    reg.configure({"cfg-plugin": {"level": 3}})
    assert received == {"level": 3}
    with pytest.raises(ConfigError, match=r"\[plugins.nope\] names no loaded plugin"):
        reg.configure({"nope": {}})


class FakeEntryPoint:
    def __init__(self, name, obj=None, error=None):
        self.name, self._obj, self._error = name, obj, error

    def load(self):
        if self._error:
            raise self._error
        return self._obj


def test_entry_points_allowlist_and_import_failure(monkeypatch):
    good = plugin_registering(make_backend("good"))
    other = plugin_registering(make_backend("other"))
    eps = [
        FakeEntryPoint("good-plugin", good),
        FakeEntryPoint("other-plugin", other),
        FakeEntryPoint("bad-plugin", error=ImportError("no module named 'missing_dep'")),
    ]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: eps if group == "kvcore" else [])

    monkeypatch.delenv("KVCORE_LOAD_PLUGINS", raising=False)
    with pytest.warns(RuntimeWarning, match="plugin 'bad-plugin' failed to load"):
        reg = BackendRegistry()
        names = set(reg.backends)
    assert {"good", "other", "naive"} <= names

    monkeypatch.setenv("KVCORE_LOAD_PLUGINS", "good-plugin")
    assert {"good", "naive"} <= set(BackendRegistry().backends)
    assert "other" not in BackendRegistry().backends

    monkeypatch.setenv("KVCORE_LOAD_PLUGINS", "")
    assert not {"good", "other"} & set(BackendRegistry().backends)


def test_plugins_load_lazily():
    reg = BackendRegistry(load_entrypoints=False)
    assert reg.pm.get_plugins() == set()
    reg.get("naive")
    assert reg.pm.get_plugins()


def test_hooks_are_documented_in_readme():
    from pathlib import Path

    from kvcore import hookspecs

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    hooks = [n for n in dir(hookspecs) if n.startswith("kvcore_")]
    assert hooks
    for hook in hooks:
        assert hook in readme, f"hook {hook} is not documented in README.md"


def test_backend_refuses_unsupported_dtype_and_head_size(with_plugin, random_model):
    from kvcore import Engine, EngineConfig

    narrow = make_backend(
        "narrow",
        capabilities=BackendCapabilities(
            devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}), cache_kinds=("contiguous",),
            head_dims=frozenset({64, 128}),
        ),
    )
    reg = with_plugin(plugin_registering(narrow), "narrow-plugin")
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

    from kvcore.support import backend_rows, markdown_table

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    start, end = "<!-- backends-table:start -->\n", "\n<!-- backends-table:end -->"
    documented = readme[readme.index(start) + len(start) : readme.index(end)]
    builtin_rows = [r for r in backend_rows(registry) if r["plugin"] in BUILTIN_PLUGINS]
    assert documented == markdown_table(builtin_rows), "run `kvcore backends --markdown` and update README.md"
