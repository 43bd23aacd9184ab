"""The options a plugin class takes from its config table (``[backends.<name>]`` ...), and the error for a
name it does not take: the plugin, the table, the options it does take and the closest one."""

from __future__ import annotations

import inspect
from collections.abc import Iterable

from kvcore.errors import ConfigError, did_you_mean

__all__ = ["accepted_options", "unknown_options_error"]

#: constructor parameters the engine passes itself, never a config table
_NOT_OPTIONS = {"self", "spec"}


def accepted_options(cls: type) -> list[str]:
    """The keyword names ``cls``'s constructor chain takes: each ``__init__`` up the MRO until one that takes no
    ``**options`` (its parents then never see a keyword)."""
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        params = inspect.signature(init).parameters.values()
        names += [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                  and p.name not in _NOT_OPTIONS and p.name not in names]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def unknown_options_error(what: str, name: str, table: str, cls: type, unknown: Iterable[str]) -> ConfigError:
    """The ConfigError for options ``unknown`` given to ``what`` (``"backend"``) ``name`` from ``[table.name]``."""
    unknown = sorted(unknown)
    accepted = accepted_options(cls)
    takes = f"it takes: {', '.join(accepted)}" if accepted else "it takes none"
    hint = next((h for h in (did_you_mean(u, accepted) for u in unknown) if h), "")
    return ConfigError(f"{what} '{name}' got unknown options: {', '.join(unknown)} in [{table}.{name}] ({takes}){hint}",
                       key=(table, name, unknown[0]))
