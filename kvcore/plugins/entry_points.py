"""Third-party plugins: the modules packages declare in the ``kvcore`` entry-point group, loaded into a pluggy
manager. Apart from the registry (which imports the interfaces, and so torch), so that the command line can list
the commands plugins add (``kvcore_register_commands``) while importing only what those plugins import.

``KVCORE_LOAD_PLUGINS`` (comma-separated entry-point names) limits which load; an empty string loads none.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import warnings

import pluggy

from kvcore import hookspecs

__all__ = ["ENTRY_POINT_GROUP", "command_plugins", "load_entry_points", "reset_command_plugins"]

ENTRY_POINT_GROUP = "kvcore"

#: entry points that failed to load in this process: each is reported once, however many managers load it
_FAILED: set[str] = set()


def load_entry_points(pm: pluggy.PluginManager) -> list[str]:
    """Register every allowed entry point of the ``kvcore`` group in ``pm``, skipping names already registered.
    One that fails to load is skipped with a warning (once per process); returns those warnings' messages."""
    allow = os.environ.get("KVCORE_LOAD_PLUGINS")
    allowed = None if allow is None else {n.strip() for n in allow.split(",") if n.strip()}
    failures = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if (allowed is not None and ep.name not in allowed) or pm.get_plugin(ep.name) is not None:
            continue
        try:
            pm.register(ep.load(), name=ep.name)
        except Exception as exc:
            message = f"kvcore: plugin '{ep.name}' failed to load and was skipped: {type(exc).__name__}: {exc}"
            failures.append(message)
            if ep.name not in _FAILED:
                _FAILED.add(ep.name)
                warnings.warn(message, RuntimeWarning, stacklevel=2)
    return failures


@functools.cache
def command_plugins() -> pluggy.PluginManager:
    """The process-wide manager whose ``kvcore_register_commands`` hooks add ``kvcore`` subcommands: the
    third-party plugins (built-in commands are the command line's own). Tests and notebooks may register more."""
    pm = pluggy.PluginManager("kvcore")
    pm.add_hookspecs(hookspecs)
    load_entry_points(pm)
    return pm


def reset_command_plugins() -> None:
    """Forget the command manager and which entry points failed (tests; after changing KVCORE_LOAD_PLUGINS)."""
    command_plugins.cache_clear()
    _FAILED.clear()
