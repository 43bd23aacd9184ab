"""The pluggable kinds (backends, KV caches, samplers, architectures, proposers, attention variants) and the
checks every registration and every use of a registered class goes through: declared attributes and capability types, an
``availability()`` under a time limit, constructor options that fail as a ConfigError."""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import Any

from kvcore.errors import ConfigError, PluginError
from kvcore.interfaces.attention import AttentionBackend, BackendCapabilities
from kvcore.interfaces.kv_cache import CacheCapabilities, KVCache
from kvcore.interfaces.layer_attention import VARIANTS
from kvcore.interfaces.options import accepted_options, unknown_options_error
from kvcore.interfaces.proposer import Proposer, ProposerCapabilities
from kvcore.interfaces.sampler import Sampler
from kvcore.interfaces.variants import AttentionVariant
from kvcore.model.architectures import Architecture

__all__ = ["Kind", "KINDS", "BACKEND", "KV_CACHE", "SAMPLER", "ARCHITECTURE", "PROPOSER", "VARIANT", "PluginEntry",
           "label"]


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
PROPOSER = Kind("proposer", "kvcore_register_proposers", Proposer, "proposers", ("name",))
#: its options table is not ``attention_variants``: that key is the list that selects them
VARIANT = Kind("attention_variant", "kvcore_register_attention_variants", AttentionVariant, "variants", ("name",))
#: in collection order: backends are checked against the KV layouts the registered caches provide
KINDS = (KV_CACHE, BACKEND, SAMPLER, ARCHITECTURE, PROPOSER, VARIANT)
#: seconds an ``availability()`` check may take before it is reported as hung (it must not block listing)
AVAILABILITY_TIMEOUT_S = 10.0
_HUNG: set[type] = set()  # classes whose availability() never returned: not called again


def label(kind: Kind) -> str:
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


def construct(entry: PluginEntry, args: tuple, options: dict[str, Any] | None) -> Any:
    """``entry.cls(*args, **options)``; a constructor that rejects the options' names is a ConfigError."""
    try:
        return entry.cls(*args, **(options or {}))
    except ConfigError as exc:  # a value of its options: the config file's line is its table's
        if options and not exc.key:
            exc.key = (entry.kind.table, entry.name)
        raise
    except TypeError as exc:
        if not options or "argument" not in str(exc):
            raise
        accepted = accepted_options(entry.cls)
        unknown = [k for k in options if k not in accepted]
        if unknown:  # a constructor with named parameters only: Python's TypeError names no alternative
            raise unknown_options_error(label(entry.kind), entry.name, entry.kind.table, entry.cls, unknown) from None
        table = f"[{entry.kind.table}.{entry.name}]"
        raise ConfigError(f"{label(entry.kind)} '{entry.name}' rejected its options {table}: {exc}",
                          key=(entry.kind.table, entry.name)) from None


def validated_entry(kind: Kind, cls: Any, name: str | None, plugin: str) -> PluginEntry:
    what = label(kind)
    if not (inspect.isclass(cls) and issubclass(cls, kind.base)):
        raise PluginError(f"plugin '{plugin}' registered {cls!r}, which is not a subclass of {kind.base.__name__}")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise PluginError(f"plugin '{plugin}': {what} class {cls.__qualname__} does not implement: {missing}")
    name = name or getattr(cls, "name", None)
    if not name or not isinstance(name, str):
        raise PluginError(f"plugin '{plugin}': {what} class {cls.__qualname__} has no 'name'")
    for attr in kind.required[1:]:
        if not hasattr(cls, attr):
            raise PluginError(f"plugin '{plugin}': {what} '{name}' declares no '{attr}'")
    expected = {BACKEND.key: BackendCapabilities, KV_CACHE.key: CacheCapabilities,
                PROPOSER.key: ProposerCapabilities}.get(kind.key)
    if expected is not None and not isinstance(cls.capabilities, expected):
        got = type(cls.capabilities).__name__
        raise PluginError(f"plugin '{plugin}': {what} '{name}' capabilities must be a {expected.__name__}, got {got}")
    if kind is BACKEND and not (
        isinstance(cls.capabilities.kv_layouts, tuple) and cls.capabilities.kv_layouts
        and all(isinstance(x, str) for x in cls.capabilities.kv_layouts)
    ):
        raise PluginError(f"plugin '{plugin}': backend '{name}' must declare kv_layouts as a non-empty tuple of names")
    if kind is VARIANT and name in VARIANTS:  # capabilities and reasons would mean the built-in one
        raise PluginError(f"plugin '{plugin}': {what} name '{name}' is a built-in variant's; rename it")
    if kind is KV_CACHE and not (isinstance(cls.layout, str) and cls.layout):
        raise PluginError(f"plugin '{plugin}': KV cache '{name}' must declare its layout as a name")
    return PluginEntry(name=name, cls=cls, plugin=plugin, kind=kind)
