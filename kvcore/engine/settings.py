"""Run settings as the Python API takes them: a config file (or the CLI's merged flags) split into the
engine's :class:`~kvcore.engine.config.EngineConfig`, the requests' :class:`~kvcore.interfaces.sampler.SamplingParams`
and the plugins' option tables.

The dataclasses are the one definition of every setting: the TOML keys (:mod:`kvcore.engine.file_config`) and
the CLI flags (:mod:`kvcore.cli.parser`) are derived from their declared fields (:mod:`kvcore.engine.fields`);
``tests/engine/test_settings.py`` keeps the HTTP fields in step with them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvcore.engine.config import EngineConfig
from kvcore.engine.file_config import file_keys, load_config
from kvcore.engine.threads import apply_threads
from kvcore.errors import ConfigError, did_you_mean
from kvcore.interfaces.sampler import SamplingParams
from kvcore.loaders import DEFAULT_MODEL
from kvcore.plugins.registry import PluginRegistry, get_registry

__all__ = ["Settings", "load_settings", "settings_from", "prepare_run"]

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
    #: the config file these came from (:func:`load_settings`): a ConfigError then names its line
    config_file: Path | None = None


def settings_from(values: dict[str, Any]) -> Settings:
    """Split flat settings keyed as in the config file (``None``: not given, the default applies) into
    :class:`Settings`. The option tables (``backends``, ``kv_caches``, ``samplers``, ``plugins``, ...) become
    the fields they fill (``backend_options``, ...). An unknown key is a ConfigError naming it."""
    known = file_keys()
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"unknown setting '{unknown[0]}' (known: {', '.join(sorted(known))})"
                          f"{did_you_mean(unknown[0], known)}")
    given = {known[k].name: dict(v) if known[k].kind is dict else v for k, v in values.items() if v is not None}
    return Settings(
        model=given.get("model", DEFAULT_MODEL),
        engine=EngineConfig(**{k: v for k, v in given.items() if k in _ENGINE}),
        sampling=SamplingParams(**{k: v for k, v in given.items() if k in _SAMPLING}),
        threads=given.get("threads"),
        plugin_options=given.get("plugin_options", {}),
    )


def load_settings(path: str | Path, **overrides: Any) -> Settings:
    """The settings of config file ``path`` (see :mod:`kvcore.engine.file_config`); ``overrides`` (config-file
    keys, ``None`` = keep the file's) win over the file. Errors name the key: ConfigError."""
    file_cfg = load_config(path)
    values = {key: getattr(file_cfg, key) for key in file_keys()}
    values.update({k: v for k, v in overrides.items() if v is not None or k not in values})
    return dataclasses.replace(settings_from(values), config_file=Path(path))


def prepare_run(settings: Settings, registry: PluginRegistry | None = None) -> PluginRegistry:
    """What ``Engine.from_settings`` does before the model loads: torch's thread count set to ``threads`` through
    the CLI's code path (:func:`~kvcore.engine.threads.apply_threads`; unset, torch is left alone: see there why),
    then the ``[plugins.<name>]`` tables handed to the plugins. Returns the registry (``get_registry()`` if none)."""
    apply_threads(settings.threads, choose=False)  # before loading: conversion and packing run on these threads
    registry = registry or get_registry()
    if settings.plugin_options:
        registry.configure(settings.plugin_options)
    return registry
