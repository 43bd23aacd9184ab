"""The TOML config file: run settings plus per-backend, per-cache, per-sampler and per-plugin option tables.

Example ``kvcore.toml``::

    backend = "paged"           # or prefill_backend / decode_backend
    kv_cache = "int8"           # a KV-cache layout the backend reads (default: the backend's own)
    sampler = "default"
    model = "smollm2"
    dtype = "float32"
    weights = "auto"            # or float / int8 / int4 (weight-only quantized matmuls, bfloat16 on CPU)
    lm_head = "dense"           # or int4 (int4 scores, the top 64 rescored densely; bfloat16 on CPU)
    compile = false             # torch.compile the decode steps
    proposer = "ngram"          # speculative decoding (docs/speculative.md)
    attention_variants = ["alibi"]  # registered attention variants (docs/attention-variants.md)
    max_new_tokens = 64
    temperature = 0.0

    [kv_caches.int8]            # keyword arguments for that cache's constructor
    block_size = 32

    [variants.alibi]            # keyword arguments for that attention variant's constructor
    max_bias = 8.0

    [plugins.my_plugin]         # handed to that plugin's kvcore_configure hook
    some_option = true

Every key is a declared field (:func:`~kvcore.interfaces.setting.setting`) of the dataclasses in
:data:`kvcore.engine.fields.SETTINGS`, a table field under its table's name; the field's type is the type the
file must give (a tuple of strings: a list of strings).
"""

from __future__ import annotations

import contextlib
import functools
import re
import tomllib
from collections.abc import Iterator
from dataclasses import field, make_dataclass
from pathlib import Path
from typing import Any

from kvcore.engine import fields as declarations
from kvcore.errors import ConfigError, did_you_mean
from kvcore.interfaces.setting import Declared, check_declared, declared

__all__ = ["FileConfig", "file_keys", "load_config", "located", "errors_located", "empty_config", "OPTION_TABLES"]

#: the TOML types a setting of each kind takes
_TOML_TYPES = {bool: (bool,), int: (int,), float: (int, float), str: (str,), tuple: (list,)}


def file_keys() -> dict[str, Declared]:
    """Every config-file key, with the field that declares it."""
    return {d.setting.table or d.name: d for cls in declarations.SETTINGS.values() for d in declared(cls)}


@functools.cache
def _file_config(keys: tuple[tuple[str, bool], ...]) -> type:
    """The dataclass of a config file's values with these ``(key, is_table)``."""
    return make_dataclass("FileConfig", [(k, Any, field(default_factory=dict) if is_table else field(default=None))
                                         for k, is_table in keys])


def _keys(known: dict[str, Declared]) -> tuple[tuple[str, bool], ...]:
    return tuple((key, d.kind is dict) for key, d in known.items())


#: the values of a config file, one attribute per key (None, or a table's ``{}``, where the file has none)
FileConfig = _file_config(_keys(file_keys()))
#: config tables of per-name constructor options, and the EngineConfig field each one fills
OPTION_TABLES = {d.setting.table: d.name for d in declared(declarations.EngineFields) if d.setting.table}


def empty_config() -> FileConfig:
    """The values of a config file that sets nothing."""
    return _file_config(_keys(file_keys()))()


def load_config(path: str | Path) -> FileConfig:
    """Read and validate a config file: each key declared, each value of its type and accepted by its setting's
    checks alone; an error is a ConfigError naming the file and line (:func:`located`)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file '{path}' is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    except OSError as exc:  # unreadable (permissions), a device, ...
        raise ConfigError(f"cannot read config file '{path}': {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file '{path}' is not valid TOML: {exc}") from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise ConfigError(f"config file '{path}' is not valid TOML: values nested too deeply") from None
    known = file_keys()
    tables = [key for key, d in known.items() if d.kind is dict]
    values: dict[str, Any] = {}
    for key, value in data.items():
        try:
            _check_key(key, value, known, tables)
        except ConfigError as exc:
            exc = located(exc, path, text)
            if exc.key:  # given where the scan does not look (an inline table): the file, without a line
                exc.args = (f"config file '{path}': {exc}",)
            raise exc from None
        values[key] = value
    return _file_config(_keys(known))(**values)


def _check_key(key: str, value: object, known: dict[str, Declared], tables: list[str]) -> None:
    """A ConfigError (its ``key`` set) unless top-level ``key`` is a declared setting and ``value`` one it takes:
    the TOML type, then the setting's own checks (ranges, choices) on this value alone, before any model loads."""
    if isinstance(value, dict) and key not in tables:  # a [section] whose name is no table's
        sub = next((k for k, v in value.items() if isinstance(v, dict)), None)
        section = f"[{key}.{sub}]" if sub else f"[{key}]"
        hint = did_you_mean(key, tables) or f" (sections: {', '.join(f'[{t}.<name>]' for t in tables)})"
        raise ConfigError(f"unknown section {section}{hint}", key=(key,))
    if key not in known:
        raise ConfigError(f"unknown key '{key}' (known: {', '.join(sorted(known))}){did_you_mean(key, known)}",
                          key=(key,))
    if key in tables:
        if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
            raise ConfigError(f"'{key}' must hold tables like [{key}.<name>]", key=(key,))
        return
    types_ = _TOML_TYPES[known[key].kind]
    is_strings = not isinstance(value, list) or all(isinstance(v, str) for v in value)
    if isinstance(value, bool) and bool not in types_ or not isinstance(value, types_) or not is_strings:
        expected = " or ".join(t.__name__ for t in types_)
        raise ConfigError(f"key '{key}' must be {expected}, got {value!r}", key=(key,))
    cls = next(c for c in declarations.SETTINGS.values() if any(d.name == known[key].name for d in declared(c)))
    try:
        check_declared(cls(**{known[key].name: value}), ConfigError)  # SamplingParams checks its own ranges too
    except ConfigError as exc:
        raise ConfigError(str(exc), key=(key,)) from None


@contextlib.contextmanager
def errors_located(path: str | Path | None) -> Iterator[None]:
    """Run the block; a ConfigError raised in it is :func:`located` in config file ``path`` (None: as it is)."""
    try:
        yield
    except ConfigError as exc:
        if path is not None:
            located(exc, path)
        raise


def located(error: ConfigError, path: str | Path, text: str | None = None) -> ConfigError:
    """``error`` with the config file and the line that gives its ``key`` in front of its message, where the file
    (text ``text``, else read from ``path``) gives it; else ``error`` as it was. The one place a config error
    gets its file and line, for the file's own checks and for the options a plugin constructor rejects."""
    if not error.key:
        return error
    if text is None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return error
    line = _line_of(text, error.key)
    if line is None:
        return error
    error.args = (f"config file '{path}', line {line}: {error}",)
    error.key = ()  # located once: an outer handler leaves it as it is
    return error


_HEADER = re.compile(r"^\s*\[\[?([^\[\]]+)\]\]?\s*(#.*)?$")
_ASSIGNMENT = re.compile(r"^\s*([A-Za-z0-9_\-.\"' ]+?)\s*=")


def _dotted(name: str) -> tuple[str, ...]:
    """``'a. "b" .c'`` → ``("a", "b", "c")`` (a quoted part holding a dot is split too: rare in a config file)."""
    return tuple(part.strip().strip("\"'") for part in name.split("."))


def _line_of(text: str, key: tuple[str, ...]) -> int | None:
    """The line that gives ``key`` (``("backends", "sdpa", "blok_size")``): the first whose dotted path (its table
    header's, or the current table's plus the key it assigns) shares the longest leading part with ``key``, one
    being the other's start: the option's own line, else its table's header. tomllib reports lines for syntax errors
    only, so the text is scanned; a line inside a multi-line string may be taken for a key."""
    best, best_len, table = None, 0, ()
    for number, line in enumerate(text.splitlines(), 1):
        header = _HEADER.match(line)
        if header:
            table = path = _dotted(header[1])
        else:
            assignment = _ASSIGNMENT.match(line)
            if not assignment:
                continue
            path = table + _dotted(assignment[1])
        common = min(len(path), len(key))
        if path[:common] == key[:common] and common > best_len:
            best, best_len = number, common
    return best
