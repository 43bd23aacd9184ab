"""Plugin discovery and the backend registry.

Built-in backends are plugins registered through the same ``kvcore_register_backends`` hook as
third-party ones; third-party plugins come from the ``kvcore`` entry-point group. Everything is loaded
lazily, on the first call that needs the registry.

``KVCORE_LOAD_PLUGINS`` (comma-separated entry-point names) limits which third-party plugins load;
set to an empty string to load none. Built-ins always load.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import os
import warnings
from dataclasses import dataclass
from typing import Any

import pluggy

from kvcore import hookspecs
from kvcore.attention import AttentionBackend
from kvcore.errors import BackendUnavailableError, ConfigError, PluginError, UnknownBackendError

__all__ = ["BackendEntry", "BackendRegistry", "get_registry", "reset_registry", "BUILTIN_PLUGINS"]

ENTRY_POINT_GROUP = "kvcore"
BUILTIN_PLUGINS = (
    "kvcore.backends.naive",
    "kvcore.backends.sdpa",
    "kvcore.backends.paged",
    "kvcore.backends.flash_attn2",
    "kvcore.backends.xformers",
)


@dataclass(frozen=True)
class BackendEntry:
    name: str
    cls: type[AttentionBackend]
    plugin: str  # name of the plugin that registered it

    def availability(self) -> str | None:
        try:
            return self.cls.availability()
        except Exception as exc:  # an availability check must never take the registry down
            return f"availability check raised {type(exc).__name__}: {exc}"


class BackendRegistry:
    """Loads plugins into a pluggy manager and collects the backends they register."""

    def __init__(self, load_entrypoints: bool = True, builtins: tuple[str, ...] = BUILTIN_PLUGINS) -> None:
        self.pm = pluggy.PluginManager("kvcore")
        self.pm.add_hookspecs(hookspecs)
        self._builtins = builtins
        self._load_entrypoints = load_entrypoints
        self._backends: dict[str, BackendEntry] | None = None
        self.load_warnings: list[str] = []
        self.conflicts: dict[str, str] = {}  # backend name -> why it is ambiguous

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
        registered = self.pm.register(plugin, name=name)
        self._backends = None  # collect again on next use
        return registered

    def unregister_plugin(self, name: str) -> None:
        self.pm.unregister(name=name)
        self._backends = None

    def _collect(self) -> dict[str, BackendEntry]:
        if not self.pm.get_plugins():
            self._load_plugins()
        backends: dict[str, BackendEntry] = {}
        self.conflicts = {}
        claimed: dict[str, list[str]] = {}  # backend name -> plugins that registered it
        for impl in self.pm.hook.kvcore_register_backends.get_hookimpls():
            plugin_name = impl.plugin_name

            def register(backend_cls: Any, *, name: str | None = None, _plugin: str = plugin_name) -> None:
                # Problems are recorded, not raised: one bad plugin must not take the others down.
                try:
                    entry = _validated_entry(backend_cls, name, _plugin)
                except PluginError as exc:
                    self._warn(f"kvcore: {exc}; backend rejected")
                    return
                owners = claimed.setdefault(entry.name, [])
                owners.append(_plugin)
                if len(owners) > 1:
                    self.conflicts[entry.name] = (
                        f"backend name '{entry.name}' is registered twice: by plugin '{owners[0]}' and by "
                        f"plugin '{_plugin}'; uninstall one or limit plugins with KVCORE_LOAD_PLUGINS"
                    )
                    backends.pop(entry.name, None)
                    self._warn(f"kvcore: {self.conflicts[entry.name]}")
                    return
                backends[entry.name] = entry

            try:
                impl.function(register=register)
            except Exception as exc:
                self._warn(
                    f"kvcore: plugin '{plugin_name}' raised in kvcore_register_backends and was skipped: "
                    f"{type(exc).__name__}: {exc}"
                )
        return backends

    @property
    def backends(self) -> dict[str, BackendEntry]:
        if self._backends is None:
            self._backends = self._collect()
        return self._backends

    def configure(self, plugin_options: dict[str, dict[str, Any]]) -> None:
        """Hand each plugin its ``[plugins.<name>]`` table through ``kvcore_configure``."""
        self.backends  # noqa: B018 - make sure plugins are loaded
        known = {name for name, _ in self.pm.list_name_plugin()}
        for name in plugin_options:
            if name not in known:
                loaded = ", ".join(sorted(known))
                raise ConfigError(f"config: [plugins.{name}] names no loaded plugin (loaded: {loaded})")
        for impl in self.pm.hook.kvcore_configure.get_hookimpls():
            impl.function(options=dict(plugin_options.get(impl.plugin_name, {})))

    # -- lookup --------------------------------------------------------------------------------------
    def get(self, name: str) -> BackendEntry:
        backends = self.backends
        if name in self.conflicts:
            raise PluginError(self.conflicts[name])
        try:
            return backends[name]
        except KeyError:
            close = difflib.get_close_matches(name, list(backends), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            known = ", ".join(sorted(self.backends))
            raise UnknownBackendError(f"unknown backend '{name}' (registered: {known}){hint}") from None

    def create(self, name: str, options: dict[str, Any] | None = None) -> AttentionBackend:
        """Instantiate an available backend; raises with the reason when it cannot run here."""
        entry = self.get(name)
        reason = entry.availability()
        if reason:
            raise BackendUnavailableError(f"backend '{name}' is unavailable: {reason}")
        return entry.cls(**(options or {}))

    def available(self) -> list[BackendEntry]:
        return [e for e in self.backends.values() if e.availability() is None]


def _validated_entry(backend_cls: Any, name: str | None, plugin: str) -> BackendEntry:
    if not (inspect.isclass(backend_cls) and issubclass(backend_cls, AttentionBackend)):
        raise PluginError(f"plugin '{plugin}' registered {backend_cls!r}, which is not an AttentionBackend subclass")
    if inspect.isabstract(backend_cls):
        missing = ", ".join(sorted(backend_cls.__abstractmethods__))
        raise PluginError(f"plugin '{plugin}': backend class {backend_cls.__qualname__} does not implement: {missing}")
    name = name or getattr(backend_cls, "name", None)
    if not name or not isinstance(name, str):
        raise PluginError(f"plugin '{plugin}': backend class {backend_cls.__qualname__} has no 'name'")
    if not hasattr(backend_cls, "capabilities"):
        raise PluginError(f"plugin '{plugin}': backend '{name}' declares no 'capabilities'")
    return BackendEntry(name=name, cls=backend_cls, plugin=plugin)


_REGISTRY: BackendRegistry | None = None


def get_registry() -> BackendRegistry:
    """The process-wide registry (created, and plugins loaded, on first use)."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = BackendRegistry()
    return _REGISTRY


def reset_registry() -> None:
    """Forget the process-wide registry (tests; after changing KVCORE_LOAD_PLUGINS)."""
    global _REGISTRY
    _REGISTRY = None
