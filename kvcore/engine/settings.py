"""Run settings as the Python API takes them: a config file (or the CLI's merged flags) split into the
engine's :class:`~kvcore.engine.config.EngineConfig`, the requests' :class:`~kvcore.interfaces.sampler.SamplingParams`
and the plugins' option tables.

The dataclasses are the one definition of every setting: a TOML key (:class:`~kvcore.engine.file_config.FileConfig`)
is a field of one of them or one of :data:`RUN_KEYS`; ``tests/test_settings.py`` keeps the CLI flags, the TOML keys
and the HTTP fields in step with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvcore.engine.config import EngineConfig
from kvcore.engine.file_config import OPTION_TABLES, FileConfig, load_config
from kvcore.engine.threads import apply_threads
from kvcore.errors import ConfigError
from kvcore.interfaces.sampler import SamplingParams
from kvcore.loaders import DEFAULT_MODEL
from kvcore.plugins.registry import PluginRegistry, get_registry

__all__ = ["Settings", "RUN_KEYS", "load_settings", "settings_from", "prepare_run"]

#: settings that belong to the run, not to the engine or a request
RUN_KEYS = {"model": "the model spec (smollm2, a .gguf file or a Hugging Face directory)",
            "threads": "torch CPU threads (CLI default: the cores not busy with other work; API: torch's own)",
            "plugins": "[plugins.<name>] tables handed to each plugin's kvcore_configure hook"}

_ENGINE = {f.name for f in fields(EngineConfig)}
_SAMPLING = {f.name for f in fields(SamplingParams)}


@dataclass(frozen=True)
class Settings:
    """Everything a run needs: ``Engine.from_settings(s)`` builds the engine, ``s.sampling`` goes with each
    request."""

    model: str = DEFAULT_MODEL
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    threads: int | None = None
    #: ``[plugins.<name>]`` tables, for :meth:`~kvcore.plugins.registry.PluginRegistry.configure`
    plugin_options: dict[str, dict[str, Any]] = field(default_factory=dict)


def settings_from(values: dict[str, Any]) -> Settings:
    """Split flat settings keyed as in the config file (``None``: not given, the default applies) into
    :class:`Settings`. The option tables (``backends``, ``kv_caches``, ``samplers``) become the
    EngineConfig fields they fill. An unknown key is a ConfigError naming it."""
    known = {f.name for f in fields(FileConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown setting '{unknown[0]}' (known: {', '.join(sorted(known))})")
    given = {k: v for k, v in values.items() if v is not None}
    engine = {k: v for k, v in given.items() if k in _ENGINE}
    for table, option in OPTION_TABLES.items():
        if given.get(table):
            engine[option] = dict(given[table])
    return Settings(
        model=given.get("model", DEFAULT_MODEL),
        engine=EngineConfig(**engine),
        sampling=SamplingParams(**{k: v for k, v in given.items() if k in _SAMPLING}),
        threads=given.get("threads"),
        plugin_options=dict(given.get("plugins", {})),
    )


def load_settings(path: str | Path, **overrides: Any) -> Settings:
    """The settings of config file ``path`` (see :mod:`kvcore.engine.file_config`); ``overrides`` (config-file
    keys, ``None`` = keep the file's) win over the file. Errors name the key: ConfigError."""
    file_cfg = load_config(path)
    values = {f.name: getattr(file_cfg, f.name) for f in fields(FileConfig)}
    values.update({k: v for k, v in overrides.items() if v is not None or k not in values})
    return settings_from(values)


def prepare_run(settings: Settings, registry: PluginRegistry | None = None) -> PluginRegistry:
    """What ``Engine.from_settings`` does before the model loads: torch's thread count set to ``threads`` through
    the CLI's code path (:func:`~kvcore.engine.threads.apply_threads`; unset, torch is left alone: see there why),
    then the ``[plugins.<name>]`` tables handed to the plugins. Returns the registry (``get_registry()`` if none)."""
    apply_threads(settings.threads, choose=False)  # before loading: conversion and packing run on these threads
    registry = registry or get_registry()
    if settings.plugin_options:
        registry.configure(settings.plugin_options)
    return registry
