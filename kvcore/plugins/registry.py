"""Plugin discovery and the registry of the pluggable kinds: backends, KV caches, samplers, proposers, attention
variants, ...

Built-ins are plugins registered through the same ``kvcore_register_*`` hooks as third-party ones;
third-party plugins come from the ``kvcore`` entry-point group. Everything is loaded lazily, on the
first call that needs the registry.

``KVCORE_LOAD_PLUGINS`` (comma-separated entry-point names) limits which third-party plugins load
(:mod:`kvcore.plugins.entry_points`); set to an empty string to load none. Built-ins always load.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import replace
from typing import Any

import pluggy

from kvcore import hookspecs
from kvcore.errors import BackendUnavailableError, ConfigError, PluginError, UnknownBackendError, did_you_mean
from kvcore.interfaces.attention import AttentionBackend
from kvcore.interfaces.kv_cache import CacheSpec, KVCache
from kvcore.interfaces.sampler import Sampler
from kvcore.interfaces.variants import AttentionVariant
from kvcore.plugins.entry_points import load_entry_points, reset_command_plugins
from kvcore.plugins.kinds import (
    ARCHITECTURE,
    BACKEND,
    KINDS,
    KV_CACHE,
    PROPOSER,
    SAMPLER,
    VARIANT,
    Kind,
    PluginEntry,
    construct,
    label,
    validated_entry,
)

__all__ = [
    "Kind", "KINDS", "BACKEND", "KV_CACHE", "SAMPLER", "ARCHITECTURE", "PROPOSER", "VARIANT", "PluginEntry",
    "PluginRegistry",
    "get_registry", "reset_registry", "BUILTIN_PLUGINS",
]

BUILTIN_PLUGINS = (
    "kvcore.backends.contiguous",
    "kvcore.backends.naive",
    "kvcore.backends.sdpa",
    "kvcore.backends.paged",
    "kvcore.backends.cpu_decode",
    "kvcore.backends.flex",
    "kvcore.backends.quantized",
    "kvcore.backends.flash_attn2",
    "kvcore.backends.xformers",
    "kvcore.sampling.sampler",
    "kvcore.speculative.ngram",
    "kvcore.speculative.draft",
    "kvcore.model.families",
)


class PluginRegistry:
    """Loads plugins into a pluggy manager and collects the backends, KV caches and samplers they register."""

    def __init__(self, load_entrypoints: bool = True, builtins: tuple[str, ...] = BUILTIN_PLUGINS) -> None:
        self.pm = pluggy.PluginManager("kvcore")
        self.pm.add_hookspecs(hookspecs)
        self._builtins = builtins
        self._load_entrypoints = load_entrypoints
        self._entries: dict[str, dict[str, PluginEntry]] | None = None
        self.load_warnings: list[str] = []
        self.conflicts: dict[tuple[str, str], str] = {}  # (kind, name) -> why it is ambiguous
        self._ambiguous: list[PluginEntry] = []  # the entries behind those conflicts

    # -- loading -------------------------------------------------------------------------------------
    def _warn(self, message: str) -> None:
        self.load_warnings.append(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _load_plugins(self) -> None:
        for module_name in self._builtins:
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:  # a broken built-in must not hide the others
                self._warn(f"kvcore: built-in plugin '{module_name}' failed to load: {type(exc).__name__}: {exc}")
                continue
            if not self.pm.is_registered(module):
                self.pm.register(module, name=module_name)
        if self._load_entrypoints:
            self.load_warnings += load_entry_points(self.pm)

    def register_plugin(self, plugin: object, name: str | None = None) -> str:
        """Register a plugin object at run time (tests, notebooks); returns its name."""
        if not self.pm.get_plugins():
            self._load_plugins()
        registered = self.pm.register(plugin, name=name)
        self._entries = None  # collect again on next use
        return registered

    def unregister_plugin(self, name: str) -> None:
        self.pm.unregister(name=name)
        self._entries = None

    def _collect(self, kind: Kind, layouts: set[str] | None = None) -> dict[str, PluginEntry]:
        """Entries of ``kind``; ``layouts`` (the registered caches' KV layouts) checks what backends read."""
        entries: dict[str, PluginEntry] = {}
        claimed: dict[str, list[str]] = {}  # name -> plugins that registered it
        for impl in getattr(self.pm.hook, kind.hook).get_hookimpls():
            plugin_name = impl.plugin_name

            def register(cls: Any, *, name: str | None = None, _plugin: str = plugin_name) -> None:
                # Problems are recorded, not raised: one bad plugin must not take the others down.
                try:
                    entry = validated_entry(kind, cls, name, _plugin)
                    if layouts is not None and not set(cls.capabilities.kv_layouts) & layouts:
                        problem = (f"reads KV layouts {', '.join(cls.capabilities.kv_layouts)}, which no registered KV "
                                   f"cache provides (registered layouts: {', '.join(sorted(layouts)) or 'none'})")
                        entry = replace(entry, problem=problem)
                except PluginError as exc:
                    self._warn(f"kvcore: {exc}; {label(kind)} rejected")
                    return
                owners = claimed.setdefault(entry.name, [])
                if owners and owners[0] in self._builtins and _plugin not in self._builtins:
                    # A built-in name cannot be taken over: the built-in stays, the newcomer is refused.
                    self._warn(
                        f"kvcore: {label(kind)} name '{entry.name}' is built in (plugin '{owners[0]}'); plugin "
                        f"'{_plugin}' may not register it again and its {label(kind)} was rejected: rename it"
                    )
                    return
                owners.append(_plugin)
                if len(owners) > 1:
                    self.conflicts[(kind.key, entry.name)] = (
                        f"{label(kind)} name '{entry.name}' is registered twice: by plugin '{owners[0]}' and by "
                        f"plugin '{_plugin}'; uninstall one or limit plugins with KVCORE_LOAD_PLUGINS"
                    )
                    entries.pop(entry.name, None)
                    self._ambiguous.append(entry)
                    self._warn(f"kvcore: {self.conflicts[(kind.key, entry.name)]}")
                    return
                entries[entry.name] = entry

            try:
                impl.function(register=register)
            except Exception as exc:
                self._warn(
                    f"kvcore: plugin '{plugin_name}' raised in {kind.hook} and was skipped: {type(exc).__name__}: {exc}"
                )
        return entries

    def entries(self, kind: Kind) -> dict[str, PluginEntry]:
        if self._entries is None:
            if not self.pm.get_plugins():
                self._load_plugins()
            self.conflicts, self._ambiguous = {}, []
            self._entries = {}
            for k in KINDS:
                caches = [*self._entries.get(KV_CACHE.key, {}).values(), *self._ambiguous]
                layouts = {e.cls.layout for e in caches if e.kind is KV_CACHE} if k is BACKEND else None
                self._entries[k.key] = self._collect(k, layouts)
        return self._entries[kind.key]

    @property
    def backends(self) -> dict[str, PluginEntry]:
        return self.entries(BACKEND)

    @property
    def kv_caches(self) -> dict[str, PluginEntry]:
        return self.entries(KV_CACHE)

    @property
    def samplers(self) -> dict[str, PluginEntry]:
        return self.entries(SAMPLER)

    @property
    def proposers(self) -> dict[str, PluginEntry]:
        return self.entries(PROPOSER)

    @property
    def attention_variants(self) -> dict[str, PluginEntry]:
        return self.entries(VARIANT)

    def configure(self, plugin_options: dict[str, dict[str, Any]]) -> None:
        """Hand each plugin its ``[plugins.<name>]`` table through ``kvcore_configure``."""
        self.backends  # noqa: B018 - make sure plugins are loaded
        known = {name for name, _ in self.pm.list_name_plugin()}
        for name in plugin_options:
            if name not in known:
                loaded = ", ".join(sorted(known))
                raise ConfigError(f"[plugins.{name}] names no loaded plugin (loaded: {loaded})"
                                  f"{did_you_mean(name, known)}", key=("plugins", name))
        for impl in self.pm.hook.kvcore_configure.get_hookimpls():
            try:
                impl.function(options=dict(plugin_options.get(impl.plugin_name, {})))
            except Exception as exc:  # a plugin that cannot take its options is skipped, the others keep working
                self._warn(f"kvcore: plugin '{impl.plugin_name}' raised in kvcore_configure and was skipped: "
                           f"{type(exc).__name__}: {exc}")
                self.unregister_plugin(impl.plugin_name)

    # -- lookup --------------------------------------------------------------------------------------
    def check_tables(self, tables: dict[str, dict[str, Any]]) -> None:
        """A ConfigError for a ``[<table>.<name>]`` options section (``tables``: by table name) whose name no
        registered plugin of that table's kind has: its options would otherwise be ignored without a word."""
        for kind in KINDS:
            entries = self.entries(kind)
            for name in tables.get(kind.table) or {}:
                if name not in entries and (kind.key, name) not in self.conflicts:
                    known = ", ".join(sorted(entries)) or "none"
                    raise ConfigError(f"[{kind.table}.{name}] names no registered {label(kind)} (registered: {known})"
                                      f"{did_you_mean(name, entries)}", key=(kind.table, name))

    def get(self, name: str, kind: Kind = BACKEND) -> PluginEntry:
        entries = self.entries(kind)
        if (kind.key, name) in self.conflicts:
            raise PluginError(self.conflicts[(kind.key, name)])
        try:
            return entries[name]
        except KeyError:
            known = ", ".join(sorted(entries)) or "none"
            error = UnknownBackendError if kind is BACKEND else ConfigError
            raise error(f"unknown {label(kind)} '{name}' (registered: {known}){did_you_mean(name, entries)}") from None

    def _available(self, name: str, kind: Kind) -> PluginEntry:
        entry = self.get(name, kind)
        reason = entry.availability()
        if reason:
            raise BackendUnavailableError(f"{label(kind)} '{name}' is unavailable: {reason}")
        return entry

    def create(self, name: str, options: dict[str, Any] | None = None) -> AttentionBackend:
        """Instantiate an available backend; raises with the reason when it cannot run here."""
        return construct(self._available(name, BACKEND), (), options)

    def create_cache(self, name: str, spec: CacheSpec, options: dict[str, Any] | None = None) -> KVCache:
        """Allocate an available KV cache for ``spec``; raises with the reason when it cannot be used."""
        cls = self._available(name, KV_CACHE).cls
        reasons = cls.capabilities.reasons_unsupported(device=spec.device, dtype=spec.dtype)
        if reasons:
            raise BackendUnavailableError(f"KV cache '{name}' cannot hold this model here: {'; '.join(reasons)}")
        return construct(self.get(name, KV_CACHE), (spec,), options)

    def create_sampler(self, name: str, options: dict[str, Any] | None = None) -> Sampler:
        return construct(self._available(name, SAMPLER), (), options)

    def create_proposer(self, name: str, options: dict[str, Any] | None = None):
        """Instantiate an available speculative-decoding proposer (a Proposer)."""
        return construct(self._available(name, PROPOSER), (), options)

    def create_variant(self, name: str, options: dict[str, Any] | None = None) -> AttentionVariant:
        """Instantiate a registered attention variant with its ``[variants.<name>]`` options."""
        return construct(self._available(name, VARIANT), (), options)

    def available(self) -> list[PluginEntry]:
        return [e for e in self.backends.values() if e.availability() is None]


_REGISTRY: PluginRegistry | None = None


def get_registry() -> PluginRegistry:
    """The process-wide registry (created, and plugins loaded, on first use)."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = PluginRegistry()
    return _REGISTRY


def reset_registry() -> None:
    """Forget the process-wide registry and the command line's plugin manager (tests; after changing
    KVCORE_LOAD_PLUGINS)."""
    global _REGISTRY
    _REGISTRY = None
    reset_command_plugins()
