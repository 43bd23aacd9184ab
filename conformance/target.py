"""The backend under test, however it was named: a registered name, ``module:Class``, or a class."""

from __future__ import annotations

import importlib
import inspect
import types
from dataclasses import dataclass, field
from typing import Any

from kvcore.attention import AttentionBackend
from kvcore.errors import ConfigError, UnknownBackendError
from kvcore.hookspecs import hookimpl
from kvcore.plugins import BackendRegistry, get_registry

__all__ = ["Target", "resolve_target", "reference_registry", "REFERENCE_BACKEND"]

#: the oracle every backend is compared with
REFERENCE_BACKEND = "naive"

_REFERENCE_REGISTRY: BackendRegistry | None = None


def reference_registry() -> BackendRegistry:
    """A private registry holding only the built-in reference backend (no third-party plugins)."""
    global _REFERENCE_REGISTRY
    if _REFERENCE_REGISTRY is None:
        _REFERENCE_REGISTRY = BackendRegistry(load_entrypoints=False, builtins=("kvcore.backends.naive",))
    return _REFERENCE_REGISTRY


@dataclass
class Target:
    """A backend class plus the registry an :class:`~kvcore.engine.Engine` can find it in by ``name``."""

    name: str
    cls: type[AttentionBackend]
    registry: BackendRegistry
    options: dict[str, Any] = field(default_factory=dict)

    def availability(self) -> str | None:
        try:
            return self.cls.availability()
        except Exception as exc:  # never let an availability check crash the suite
            return f"availability check raised {type(exc).__name__}: {exc}"

    def make(self) -> AttentionBackend:
        return self.cls(**self.options)

    @property
    def capabilities(self):
        return self.cls.capabilities


def _import_builtin_plugins() -> None:
    """Import the built-in backend modules: they register the built-in cache kinds (``paged``...) that a
    third-party backend may read, even when it is tested without the process-wide registry."""
    from kvcore.plugins import BUILTIN_PLUGINS

    for module_name in BUILTIN_PLUGINS:
        try:
            importlib.import_module(module_name)
        except Exception:  # an optional built-in that cannot load is reported by `kvcore backends`
            pass


def _private_registry(cls: type[AttentionBackend], name: str) -> BackendRegistry:
    """A registry holding just ``cls`` (registered as a throwaway plugin), for unregistered classes."""
    registry = BackendRegistry(load_entrypoints=False, builtins=())
    plugin = types.ModuleType(f"kvcore_conformance_target_{name}")

    @hookimpl
    def kvcore_register_backends(register):
        register(cls, name=name)

    plugin.kvcore_register_backends = kvcore_register_backends
    registry.register_plugin(plugin, name=f"conformance-target-{name}")
    return registry


def resolve_target(
    spec: str | type[AttentionBackend],
    registry: BackendRegistry | None = None,
    options: dict[str, Any] | None = None,
) -> Target:
    """Find the backend to test.

    ``spec`` is a registered backend name (looked up in ``registry``, default the process-wide one), a
    ``"package.module:ClassName"`` import path, or an :class:`AttentionBackend` subclass. Raises
    :class:`~kvcore.errors.UnknownBackendError` / :class:`~kvcore.errors.ConfigError` when it names nothing.
    """
    options = dict(options or {})
    if isinstance(spec, str) and ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"cannot import backend class '{spec}': {exc}") from None
        spec = obj
    if isinstance(spec, str):
        registry = registry or get_registry()
        entry = registry.get(spec)  # UnknownBackendError / PluginError name the problem
        return Target(name=entry.name, cls=entry.cls, registry=registry, options=options)
    if isinstance(spec, AttentionBackend):
        raise ConfigError("pass the backend class (or its registered name), not an instance")
    if not (inspect.isclass(spec) and issubclass(spec, AttentionBackend)):
        raise UnknownBackendError(f"{spec!r} is not an AttentionBackend subclass")
    name = getattr(spec, "name", None) or spec.__name__
    _import_builtin_plugins()
    if registry is not None and name in registry.backends and registry.backends[name].cls is spec:
        return Target(name=name, cls=spec, registry=registry, options=options)
    return Target(name=name, cls=spec, registry=_private_registry(spec, name), options=options)
