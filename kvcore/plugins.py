"""Plugin discovery and the registry of the three pluggable kinds: backends, KV caches, samplers.

Built-ins are plugins registered through the same ``kvcore_register_*`` hooks as third-party ones;
third-party plugins come from the ``kvcore`` entry-point group. Everything is loaded lazily, on the
first call that needs the registry.

``KVCORE_LOAD_PLUGINS`` (comma-separated entry-point names) limits which third-party plugins load;
set to an empty string to load none. Built-ins always load.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import os
import threading
import warnings
from dataclasses import dataclass, replace
from typing import Any

import pluggy

from kvcore import hookspecs
from kvcore.architectures import Architecture
from kvcore.attention import AttentionBackend, BackendCapabilities
from kvcore.errors import BackendUnavailableError, ConfigError, PluginError, UnknownBackendError
from kvcore.kv_cache import CacheCapabilities, CacheSpec, KVCache
from kvcore.sampling import Sampler

__all__ = ["Kind", "KINDS", "PluginEntry", "PluginRegistry", "get_registry", "reset_registry", "BUILTIN_PLUGINS"]

ENTRY_POINT_GROUP = "kvcore"
BUILTIN_PLUGINS = (
    "kvcore.backends.contiguous",
    "kvcore.backends.naive",
    "kvcore.backends.sdpa",
    "kvcore.backends.paged",
    "kvcore.backends.quantized",
    "kvcore.backends.flash_attn2",
    "kvcore.backends.xformers",
    "kvcore.sampling",
    "kvcore.families",
)


@dataclass(frozen=True)
class Kind:
    """One pluggable kind: its hook, base class and the words used in messages and config tables."""

    key: str  # "backend", "kv_cache", "sampler"
    hook: str  # the pluggy hook that registers it
    base: type
    table: str  # config-file table of per-name options: [backends.<name>] ...
    required: tuple[str, ...]  # class attributes a registration must declare


BACKEND = Kind("backend", "kvcore_register_backends", AttentionBackend, "backends", ("name", "capabilities"))
KV_CACHE = Kind("kv_cache", "kvcore_register_kv_caches", KVCache, "kv_caches", ("name", "layout", "capabilities"))
SAMPLER = Kind("sampler", "kvcore_register_samplers", Sampler, "samplers", ("name",))
ARCHITECTURE = Kind("architecture", "kvcore_register_architectures", Architecture, "architectures", ("name",))
#: in collection order: backends are checked against the KV layouts the registered caches provide
KINDS = (KV_CACHE, BACKEND, SAMPLER, ARCHITECTURE)
#: seconds an ``availability()`` check may take before it is reported as hung (it must not block listing)
AVAILABILITY_TIMEOUT_S = 10.0
_HUNG: set[type] = set()  # classes whose availability() never returned: not called again


def _label(kind: Kind) -> str:
    return kind.key.replace("_", " ").replace("kv", "KV")


@dataclass(frozen=True)
class PluginEntry:
    name: str
    cls: type
    plugin: str  # name of the plugin that registered it
    kind: Kind
    problem: str | None = None  # why it can never be used, found at registration (e.g. an unknown KV layout)

    def availability(self) -> str | None:
        """``None`` when usable here, else the reason. The class's check runs with a time limit: one that
        raises or hangs makes the entry unavailable, never the registry."""
        if self.problem:
            return self.problem
        return _availability(self.cls)


def _availability(cls: type) -> str | None:
    if cls in _HUNG:
        return f"availability check did not return within {AVAILABILITY_TIMEOUT_S:g} s"
    outcome: list[str | None] = []

    def check() -> None:
        try:
            reason = cls.availability()
            outcome.append(None if reason is None else str(reason).splitlines()[0] if str(reason) else "unavailable")
        except Exception as exc:  # an availability check must never take the registry down
            outcome.append(f"availability check raised {type(exc).__name__}: {exc}".splitlines()[0])

    worker = threading.Thread(target=check, name=f"kvcore-availability-{cls.__name__}", daemon=True)
    worker.start()
    worker.join(AVAILABILITY_TIMEOUT_S)
    if not outcome:
        _HUNG.add(cls)
        return f"availability check did not return within {AVAILABILITY_TIMEOUT_S:g} s"
    return outcome[0]


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
        if not self._load_entrypoints:
            return
        allow = os.environ.get("KVCORE_LOAD_PLUGINS")
        allowed = None if allow is None else {n.strip() for n in allow.split(",") if n.strip()}
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if allowed is not None and ep.name not in allowed:
                continue
            if self.pm.get_plugin(ep.name) is not None:
                continue
            try:
                plugin = ep.load()
                self.pm.register(plugin, name=ep.name)
            except Exception as exc:
                self._warn(f"kvcore: plugin '{ep.name}' failed to load and was skipped: {type(exc).__name__}: {exc}")

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
                    entry = _validated_entry(kind, cls, name, _plugin)
                    if layouts is not None and not set(cls.capabilities.kv_layouts) & layouts:
                        problem = (f"reads KV layouts {', '.join(cls.capabilities.kv_layouts)}, which no registered KV "
                                   f"cache provides (registered layouts: {', '.join(sorted(layouts)) or 'none'})")
                        entry = replace(entry, problem=problem)
                except PluginError as exc:
                    self._warn(f"kvcore: {exc}; {_label(kind)} rejected")
                    return
                owners = claimed.setdefault(entry.name, [])
                if owners and owners[0] in self._builtins and _plugin not in self._builtins:
                    # A built-in name cannot be taken over: the built-in stays, the newcomer is refused.
                    self._warn(
                        f"kvcore: {_label(kind)} name '{entry.name}' is built in (plugin '{owners[0]}'); plugin "
                        f"'{_plugin}' may not register it again and its {_label(kind)} was rejected: rename it"
                    )
                    return
                owners.append(_plugin)
                if len(owners) > 1:
                    self.conflicts[(kind.key, entry.name)] = (
                        f"{_label(kind)} name '{entry.name}' is registered twice: by plugin '{owners[0]}' and by "
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

    def configure(self, plugin_options: dict[str, dict[str, Any]]) -> None:
        """Hand each plugin its ``[plugins.<name>]`` table through ``kvcore_configure``."""
        self.backends  # noqa: B018 - make sure plugins are loaded
        known = {name for name, _ in self.pm.list_name_plugin()}
        for name in plugin_options:
            if name not in known:
                loaded = ", ".join(sorted(known))
                raise ConfigError(f"config: [plugins.{name}] names no loaded plugin (loaded: {loaded})")
        for impl in self.pm.hook.kvcore_configure.get_hookimpls():
            try:
                impl.function(options=dict(plugin_options.get(impl.plugin_name, {})))
            except Exception as exc:  # a plugin that cannot take its options is skipped, the others keep working
                self._warn(f"kvcore: plugin '{impl.plugin_name}' raised in kvcore_configure and was skipped: "
                           f"{type(exc).__name__}: {exc}")
                self.unregister_plugin(impl.plugin_name)

    # -- lookup --------------------------------------------------------------------------------------
    def get(self, name: str, kind: Kind = BACKEND) -> PluginEntry:
        entries = self.entries(kind)
        if (kind.key, name) in self.conflicts:
            raise PluginError(self.conflicts[(kind.key, name)])
        try:
            return entries[name]
        except KeyError:
            close = difflib.get_close_matches(name, list(entries), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            known = ", ".join(sorted(entries))
            error = UnknownBackendError if kind is BACKEND else ConfigError
            raise error(f"unknown {_label(kind)} '{name}' (registered: {known}){hint}") from None

    def _available(self, name: str, kind: Kind) -> PluginEntry:
        entry = self.get(name, kind)
        reason = entry.availability()
        if reason:
            raise BackendUnavailableError(f"{_label(kind)} '{name}' is unavailable: {reason}")
        return entry

    def create(self, name: str, options: dict[str, Any] | None = None) -> AttentionBackend:
        """Instantiate an available backend; raises with the reason when it cannot run here."""
        return _construct(self._available(name, BACKEND), (), options)

    def create_cache(self, name: str, spec: CacheSpec, options: dict[str, Any] | None = None) -> KVCache:
        """Allocate an available KV cache for ``spec``; raises with the reason when it cannot be used."""
        cls = self._available(name, KV_CACHE).cls
        reasons = cls.capabilities.reasons_unsupported(device=spec.device, dtype=spec.dtype)
        if reasons:
            raise BackendUnavailableError(f"KV cache '{name}' cannot hold this model here: {'; '.join(reasons)}")
        return _construct(self.get(name, KV_CACHE), (spec,), options)

    def create_sampler(self, name: str, options: dict[str, Any] | None = None) -> Sampler:
        return _construct(self._available(name, SAMPLER), (), options)

    def available(self) -> list[PluginEntry]:
        return [e for e in self.backends.values() if e.availability() is None]


def _construct(entry: PluginEntry, args: tuple, options: dict[str, Any] | None) -> Any:
    """``entry.cls(*args, **options)``; a constructor that rejects the options' names is a ConfigError."""
    try:
        return entry.cls(*args, **(options or {}))
    except TypeError as exc:
        if not options or "argument" not in str(exc):
            raise
        table = f"[{entry.kind.table}.{entry.name}]"
        raise ConfigError(f"{_label(entry.kind)} '{entry.name}' rejected its options {table}: {exc}") from None


def _validated_entry(kind: Kind, cls: Any, name: str | None, plugin: str) -> PluginEntry:
    label = _label(kind)
    if not (inspect.isclass(cls) and issubclass(cls, kind.base)):
        raise PluginError(f"plugin '{plugin}' registered {cls!r}, which is not a subclass of {kind.base.__name__}")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise PluginError(f"plugin '{plugin}': {label} class {cls.__qualname__} does not implement: {missing}")
    name = name or getattr(cls, "name", None)
    if not name or not isinstance(name, str):
        raise PluginError(f"plugin '{plugin}': {label} class {cls.__qualname__} has no 'name'")
    for attr in kind.required[1:]:
        if not hasattr(cls, attr):
            raise PluginError(f"plugin '{plugin}': {label} '{name}' declares no '{attr}'")
    expected = {BACKEND.key: BackendCapabilities, KV_CACHE.key: CacheCapabilities}.get(kind.key)
    if expected is not None and not isinstance(cls.capabilities, expected):
        got = type(cls.capabilities).__name__
        raise PluginError(f"plugin '{plugin}': {label} '{name}' capabilities must be a {expected.__name__}, got {got}")
    if kind is BACKEND and not (
        isinstance(cls.capabilities.kv_layouts, tuple) and cls.capabilities.kv_layouts
        and all(isinstance(x, str) for x in cls.capabilities.kv_layouts)
    ):
        raise PluginError(f"plugin '{plugin}': backend '{name}' must declare kv_layouts as a non-empty tuple of names")
    if kind is KV_CACHE and not (isinstance(cls.layout, str) and cls.layout):
        raise PluginError(f"plugin '{plugin}': KV cache '{name}' must declare its layout as a name")
    return PluginEntry(name=name, cls=cls, plugin=plugin, kind=kind)


_REGISTRY: PluginRegistry | None = None


def get_registry() -> PluginRegistry:
    """The process-wide registry (created, and plugins loaded, on first use)."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = PluginRegistry()
    return _REGISTRY


def reset_registry() -> None:
    """Forget the process-wide registry (tests; after changing KVCORE_LOAD_PLUGINS)."""
    global _REGISTRY
    _REGISTRY = None
