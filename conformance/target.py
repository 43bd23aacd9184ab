"""What is under test: an attention backend (a registered name, ``module:Class``, or a class), optionally
paired with a KV cache and a sampler by name; the conformance suite certifies all three kinds."""

from __future__ import annotations

import importlib
import inspect
import traceback
import types
from dataclasses import dataclass, field, replace
from typing import Any

from kvcore.errors import ConfigError, KVCoreError, UnknownBackendError
from kvcore.hookspecs import hookimpl
from kvcore.interfaces.attention import AttentionBackend
from kvcore.interfaces.kv_cache import CacheSpec, KVCache
from kvcore.interfaces.sampler import Sampler
from kvcore.plugins.registry import KV_CACHE, PROPOSER, SAMPLER, PluginRegistry, get_registry

__all__ = [
    "Target", "resolve_target", "reference_target", "REFERENCE_BACKEND", "backend_for_cache", "BrokenTargetError",
    "traceback_summary", "parse_options",
]


class BrokenTargetError(KVCoreError):
    """What is under test raised before any case could run: its module at import, its ``availability()``
    or its constructor. A conformance *failure* (exit 1), not a usage error and not "unavailable"."""

    def __init__(self, message: str, summary: str = "") -> None:
        super().__init__(message)
        self.summary = summary  # the last frames of the traceback


def parse_options(values: list[str] | tuple[str, ...] | None, flag: str = "--backend-option") -> dict[str, Any]:
    """``["KEY=VALUE", ...]`` (from ``--backend-option`` and friends) -> options; a VALUE that parses as
    JSON is that value (``block_size=8`` -> 8), else the string. Raises ConfigError on a missing ``=``."""
    import json

    options: dict[str, Any] = {}
    for item in values or ():
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag} expects KEY=VALUE, got '{item}'")
        try:
            options[key.strip()] = json.loads(raw)
        except ValueError:
            options[key.strip()] = raw
    return options


def traceback_summary(exc: BaseException, frames: int = 4) -> str:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return "".join(tb[-frames:]).rstrip()

#: the oracle every backend is compared with (over the lossless "contiguous" cache, default sampler)
REFERENCE_BACKEND = "naive"
_REFERENCE_PLUGINS = ("kvcore.backends.contiguous", "kvcore.backends.naive", "kvcore.sampling.sampler")


@dataclass
class Target:
    """A backend class plus the registry an :class:`~kvcore.engine.core.Engine` can find it (and the caches and
    samplers) in by name. ``kv_cache`` / ``sampler`` name the cache and sampler under test (``None``: every
    canonical cache of the backend's layouts; the default sampler)."""

    name: str
    cls: type[AttentionBackend]
    registry: PluginRegistry
    options: dict[str, Any] = field(default_factory=dict)
    kv_cache: str | None = None
    kv_cache_options: dict[str, Any] = field(default_factory=dict)
    sampler: str | None = None
    sampler_options: dict[str, Any] = field(default_factory=dict)
    proposer: str | None = None  # the speculative-decoding proposer under test (the speculative tier)

    def availability(self) -> str | None:
        """The backend's reason it cannot run here (``None``: it can). Raises :class:`BrokenTargetError` when
        ``availability()`` itself raises: the contract says it must not, so that is a failure."""
        try:
            return self.cls.availability()
        except Exception as exc:
            raise BrokenTargetError(f"backend '{self.name}': availability() raised {type(exc).__name__}: {exc}",
                                    traceback_summary(exc)) from exc

    def preflight(self) -> None:
        """Construct the backend (and the sampler under test) once, as the engine would: a constructor that
        rejects its options is a usage error (:class:`~kvcore.errors.ConfigError`); any other exception is
        a :class:`BrokenTargetError`."""
        for what, make in ((f"backend '{self.name}'", self.make), (f"sampler '{self.sampler}'", self.make_sampler)):
            if what.startswith("sampler") and self.sampler is None:
                continue
            try:
                make()
            except KVCoreError:
                raise
            except Exception as exc:
                raise BrokenTargetError(f"{what}: constructor raised {type(exc).__name__}: {exc}",
                                        traceback_summary(exc)) from exc

    def make(self) -> AttentionBackend:
        return self.cls(**self.options)

    @property
    def capabilities(self):
        return self.cls.capabilities

    def cache_names(self) -> tuple[str, ...]:
        """The caches the backend is tested over: the one named, else the canonical cache of each layout it
        reads (the registered cache named like the layout, else the first registered with that layout)."""
        if self.kv_cache is not None:
            return (self.kv_cache,)
        names = []
        caches = self.registry.kv_caches
        for layout in self.capabilities.kv_layouts:
            same = sorted((n for n, e in caches.items() if e.cls.layout == layout), key=lambda n: n != layout)
            if same:
                names.append(same[0])
        return tuple(names)

    def other_readers(self) -> tuple[str, ...]:
        """Available built-in backends other than this one that read the layout of the cache under test
        (``naive`` first): a cache is certified through each of them, not only through the backend it came with."""
        layout = self.cache_class(self.kv_cache).layout
        names = [e.name for e in self.registry.backends.values()
                 if e.plugin.startswith("kvcore.") and e.name != self.name and layout in e.cls.capabilities.kv_layouts
                 and e.availability() is None]
        return tuple(sorted(names, key=lambda n: (n != REFERENCE_BACKEND, n)))

    def via(self, backend: str) -> Target:
        """This target with ``backend`` (a registered name, default options) in place of the backend under test."""
        return replace(self, name=backend, cls=self.registry.get(backend).cls, options={})

    def cache_class(self, name: str) -> type[KVCache]:
        return self.registry.get(name, KV_CACHE).cls

    def make_cache(self, name: str, spec: CacheSpec) -> KVCache:
        options = self.kv_cache_options if name == self.kv_cache else None
        return self.registry.create_cache(name, spec, options)

    def make_sampler(self) -> Sampler:
        return self.registry.create_sampler(self.sampler or "default", self.sampler_options)

    @property
    def unit_roundoff(self) -> float:
        """Largest relative rounding error the caches under test add to stored K/V (0 = lossless)."""
        return max((self.cache_class(n).capabilities.unit_roundoff or 0.0 for n in self.cache_names()), default=0.0)

    def describe(self) -> str:
        parts = [f"backend '{self.name}'"]
        if self.kv_cache:
            parts.append(f"KV cache '{self.kv_cache}'")
        if self.sampler:
            parts.append(f"sampler '{self.sampler}'")
        return ", ".join(parts)


def reference_target(variants: PluginRegistry | None = None) -> Target:
    """The oracle: ``naive`` over the float32-capable ``contiguous`` cache, from a private registry; with the
    attention variants registered in ``variants`` (the target's: those a run may select), which naive evaluates."""
    global _REFERENCE
    if _REFERENCE is None:
        registry = PluginRegistry(load_entrypoints=False, builtins=_REFERENCE_PLUGINS)
        _REFERENCE = Target(REFERENCE_BACKEND, registry.get(REFERENCE_BACKEND).cls, registry, kv_cache="contiguous")
    if variants is None or not variants.attention_variants:
        return _REFERENCE
    registry = PluginRegistry(load_entrypoints=False, builtins=_REFERENCE_PLUGINS)
    registry.register_plugin(_variants_plugin(variants), name="conformance-variants")
    return replace(_REFERENCE, registry=registry)


def _variants_plugin(shared: PluginRegistry) -> types.ModuleType:
    """A plugin registering ``shared``'s attention variants under their names."""
    plugin = types.ModuleType("kvcore_conformance_variants")

    @hookimpl
    def kvcore_register_attention_variants(register):
        for entry in shared.attention_variants.values():
            register(entry.cls, name=entry.name)

    plugin.kvcore_register_attention_variants = kvcore_register_attention_variants
    return plugin


_REFERENCE: Target | None = None


def _private_registry(cls: type[AttentionBackend], name: str, shared: PluginRegistry) -> PluginRegistry:
    """A registry holding just ``cls`` (registered as a throwaway plugin) beside every cache, sampler and
    attention variant (built-in and third-party) of ``shared``, for backend classes that are not registered."""
    registry = PluginRegistry(load_entrypoints=False, builtins=())
    plugin = types.ModuleType(f"kvcore_conformance_target_{name}")

    @hookimpl
    def kvcore_register_backends(register):
        register(cls, name=name)

    @hookimpl
    def kvcore_register_kv_caches(register):
        for entry in shared.kv_caches.values():
            register(entry.cls, name=entry.name)

    @hookimpl
    def kvcore_register_samplers(register):
        for entry in shared.samplers.values():
            register(entry.cls, name=entry.name)

    plugin.kvcore_register_backends = kvcore_register_backends
    plugin.kvcore_register_kv_caches = kvcore_register_kv_caches
    plugin.kvcore_register_samplers = kvcore_register_samplers
    registry.register_plugin(plugin, name=f"conformance-target-{name}")
    registry.register_plugin(_variants_plugin(shared), name="conformance-variants")
    return registry


def backend_for_cache(registry: PluginRegistry, kv_cache: str) -> str:
    """The backend that certifies a cache given alone: the highest-priority available backend that reads
    its layout (built-ins first, so a third-party cache is judged with a trusted reader)."""
    layout = registry.get(kv_cache, KV_CACHE).cls.layout
    readers = [
        e for e in registry.backends.values()
        if layout in e.cls.capabilities.kv_layouts and e.availability() is None
    ]
    if not readers:
        raise ConfigError(f"no available backend reads the '{layout}' layout of KV cache '{kv_cache}'; pass --backend")
    return max(readers, key=lambda e: (e.plugin.startswith("kvcore."), e.cls.priority, e.name)).name


def resolve_target(
    spec: str | type[AttentionBackend] | None,
    registry: PluginRegistry | None = None,
    options: dict[str, Any] | None = None,
    *,
    kv_cache: str | None = None,
    kv_cache_options: dict[str, Any] | None = None,
    sampler: str | None = None,
    sampler_options: dict[str, Any] | None = None,
    proposer: str | None = None,
) -> Target:
    """Find what to test.

    ``spec`` is a registered backend name (looked up in ``registry``, default the process-wide one), a
    ``"package.module:ClassName"`` import path, an :class:`AttentionBackend` subclass, or ``None`` with
    ``kv_cache`` given (the cache is certified with a backend that reads its layout). Raises
    :class:`~kvcore.errors.UnknownBackendError` / :class:`~kvcore.errors.ConfigError` when a name names nothing.
    """
    extra = dict(
        kv_cache=kv_cache,
        kv_cache_options=dict(kv_cache_options or {}),
        sampler=sampler,
        sampler_options=dict(sampler_options or {}),
        proposer=proposer,
    )
    options = dict(options or {})
    if spec is None:
        registry = registry or get_registry()
        if kv_cache is None:
            spec = max(registry.available(), key=lambda e: (e.cls.priority, e.name)).name
        else:
            spec = backend_for_cache(registry, kv_cache)
    if isinstance(spec, str) and ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
                raise ConfigError(f"cannot import backend class '{spec}': {exc}") from None
            raise BrokenTargetError(f"importing '{module_name}' raised {type(exc).__name__}: {exc}",
                                    traceback_summary(exc)) from exc
        except Exception as exc:  # the module exists but raises at import: the backend is broken
            raise BrokenTargetError(f"importing '{module_name}' raised {type(exc).__name__}: {exc}",
                                    traceback_summary(exc)) from exc
        try:
            spec = getattr(module, attr)
        except AttributeError as exc:
            raise ConfigError(f"cannot import backend class '{spec}': {exc}") from None
    if isinstance(spec, str):
        registry = registry or get_registry()
        entry = registry.get(spec)  # UnknownBackendError / PluginError name the problem
        target = Target(name=entry.name, cls=entry.cls, registry=registry, options=options, **extra)
    elif isinstance(spec, AttentionBackend):
        raise ConfigError("pass the backend class (or its registered name), not an instance")
    elif not (inspect.isclass(spec) and issubclass(spec, AttentionBackend)):
        raise UnknownBackendError(f"{spec!r} is not an AttentionBackend subclass")
    else:
        name = getattr(spec, "name", None) or spec.__name__
        if registry is not None and name in registry.backends and registry.backends[name].cls is spec:
            target = Target(name=name, cls=spec, registry=registry, options=options, **extra)
        else:
            target = Target(name=name, cls=spec, registry=_private_registry(spec, name, registry or get_registry()),
                            options=options, **extra)
    if kv_cache is not None:
        target.cache_class(kv_cache)  # an unknown cache name is an error naming the registered ones
    if sampler is not None:
        target.registry.get(sampler, SAMPLER)
    if proposer is not None:
        target.registry.get(proposer, PROPOSER)
    return target
