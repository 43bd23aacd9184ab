"""Declaring a run setting once: a dataclass field whose metadata says how users give it and how it is checked.

A field made with :func:`setting` is a config-file key (:mod:`kvcore.engine.file_config` derives the TOML
schema from it), a command-line flag unless ``flag=False`` (:mod:`kvcore.cli.parser` derives the argparse
argument) and a row of docs/cli.md's settings table (``scripts/gen_tables.py``): adding a setting is adding
one field. Nothing here imports torch, so the command line reads the declarations before torch loads.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any

from kvcore.errors import did_you_mean

__all__ = ["Setting", "Declared", "setting", "declared", "check_declared"]

_KEY = "kvcore.setting"


@dataclass(frozen=True)
class Setting:
    """How one setting is given and checked (a field's ``metadata["kvcore.setting"]``)."""

    help: str  # one line: the flag's ``--help`` and the docs' settings table; ``{default}`` is the field's default
    flag: str | bool = True  # the CLI flag: True = ``--`` and the field name with dashes, False = config file only
    metavar: str | None = None  # the flag's value in ``--help`` (argparse's default: the flag in capitals)
    choices: tuple[str, ...] | None = None  # the only values the flag accepts (argparse checks them)
    min: int | None = None  # an integer setting's least value (:func:`check_declared` enforces it)
    table: str | None = None  # a ``dict[str, dict]`` field: the config file's ``[table.<name>]`` sections
    commands: tuple[str, ...] | None = None  # the commands with the flag; None = every command of its group


@dataclass(frozen=True)
class Declared:
    """One declared field of a settings dataclass, as :func:`declared` reads it."""

    name: str
    kind: type  # bool, int, float, str, tuple (of strings; a repeatable flag, a TOML list) or dict (a table)
    default: Any
    setting: Setting

    @property
    def help(self) -> str:
        """The help text with ``{default}`` filled in."""
        return self.setting.help.replace("{default}", str(self.default))

    @property
    def flag(self) -> str | None:
        """The CLI flag (``--max-new-tokens``), or None for a config-file-only setting."""
        flag = self.setting.flag
        if flag is True:
            return "--" + self.name.replace("_", "-")
        return flag or None


def setting(default: Any = MISSING, *, help: str, default_factory: Any = MISSING, **how: Any) -> Any:
    """A dataclass field that is a run setting: ``max_new_tokens: int = setting(128, help="tokens to
    generate")``. ``how``: the other :class:`Setting` fields (``flag``, ``metavar``, ``choices``, ``min``,
    ``table``, ``commands``)."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={_KEY: Setting(help=help, **how)})


@functools.cache  # a class's fields do not change, and EngineConfig checks its values with them
def declared(cls: type) -> tuple[Declared, ...]:
    """The fields of dataclass ``cls`` made with :func:`setting`, in field order. A TypeError names a field whose
    type no config file or flag can give."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if _KEY in f.metadata:
            if f.default is MISSING and f.default_factory is MISSING:
                raise TypeError(f"{cls.__name__}.{f.name}: a setting needs a default (a file or flag may leave it out)")
            default = f.default_factory() if f.default is MISSING else f.default
            out.append(Declared(f.name, _kind(cls, f.name, hints[f.name]), default, f.metadata[_KEY]))
    return tuple(out)


def _kind(cls: type, name: str, annotation: Any) -> type:
    """``int | None`` → int; ``tuple[str, ...]`` → tuple; ``dict[str, dict[str, Any]]`` → dict."""
    args = [a for a in typing.get_args(annotation) if a is not types.NoneType]
    kind = args[0] if isinstance(annotation, types.UnionType) and len(args) == 1 else annotation
    origin = typing.get_origin(kind) or kind
    if origin in (bool, int, float, str, dict) or kind == tuple[str, ...]:
        return origin
    raise TypeError(f"{cls.__name__}.{name}: a setting is a bool, int, float, str, tuple[str, ...] or a dict of "
                    f"tables, optionally | None; not {annotation}")


def check_declared(obj: Any, error: type[Exception]) -> None:
    """Raise ``error`` naming the first declared field of ``obj`` whose value has the wrong type (bool, int), is
    below its ``min`` or is none of its ``choices`` (None passes where the field's default is None)."""
    for d in declared(type(obj)):
        value = getattr(obj, d.name)
        if d.setting.choices and value not in d.setting.choices:
            raise error(f"{d.name} must be one of: {', '.join(d.setting.choices)}; got {value!r}"
                        f"{did_you_mean(str(value), d.setting.choices)}")
        if d.kind is bool and not isinstance(value, bool):
            raise error(f"{d.name} must be true or false, got {value!r}")
        if d.kind is int and d.setting.min is not None and not (value is None and d.default is None):
            if not isinstance(value, int) or isinstance(value, bool) or value < d.setting.min:
                least = "a positive integer" if d.setting.min == 1 else f"an integer > {d.setting.min - 1}"
                raise error(f"{d.name} must be {least}, got {value!r}")
