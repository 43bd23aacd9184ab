"""Where a command's settings come from: flag > environment > config file > defaults; the prompt (argument,
``-`` for standard input, or ``--prompt-file``). The thread count is kvcore.engine.threads's, shared with the API."""

from __future__ import annotations

import argparse
import os
import stat
import sys
from typing import Any

from kvcore.errors import ConfigError, InvalidRequestError

__all__ = ["ENVIRONMENT", "DEFAULTS", "MAX_PROMPT_BYTES", "read_bounded_text", "read_bounded_stdin",
           "resolve_settings", "read_prompt", "with_piped_stdin"]

#: settings an environment variable may give (between flag and config file)
ENVIRONMENT = {"backend": "KVCORE_BACKEND", "model": "KVCORE_MODEL"}
#: defaults of the settings that have no default in EngineConfig / SamplingParams
DEFAULTS = {"model": "smollm2", "max_num_seqs": 1}
#: the largest prompt read from --prompt-file or standard input (bytes): far above any model's context, so the
#: prompt's length check is what a real prompt meets; the bound keeps a device or an endless pipe (``/dev/zero``)
#: from being read into memory
MAX_PROMPT_BYTES = 16 << 20


def read_bounded_text(path: str, what: str, limit: int) -> str:
    """The text of a file a flag names (``what``: how messages call it, e.g. ``"prompt file"``): a regular file
    (or a pipe, ``<(...)``) of at most ``limit`` bytes, read no further than that (``/dev/zero`` never ends),
    UTF-8; ConfigError otherwise."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
                raise ConfigError(f"{what} '{path}' is not a regular file")
            return _read_bounded(f, f"{what} '{path}'", limit)
    except OSError as exc:  # missing, unreadable, a directory
        raise ConfigError(f"cannot read {what} '{path}': {exc.strerror or exc}") from None


def read_bounded_stdin(stdin, limit: int = MAX_PROMPT_BYTES, line: bool = False) -> str:
    """All of ``stdin`` (or its next line, ``line``) as text with ``\n`` line ends, read no further than ``limit``
    bytes (a pipe from ``/dev/zero`` never ends), with the errors of :func:`read_bounded_text`. A stream without a
    binary buffer (a test's stand-in) counts characters."""
    binary = getattr(stdin, "buffer", None)
    if binary is None:
        text = stdin.readline(limit + 1) if line else stdin.read(limit + 1)
        if len(text) > limit:
            raise ConfigError(f"standard input is larger than {limit} bytes")
        return text
    return _read_bounded(binary, "standard input", limit, line).replace("\r\n", "\n").replace("\r", "\n")


def _read_bounded(f, what: str, limit: int, line: bool = False) -> str:
    raw = f.readline(limit + 1) if line else f.read(limit + 1)
    if len(raw) > limit:
        raise ConfigError(f"{what} is larger than {limit} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None


def resolve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Merge flag > environment (KVCORE_BACKEND, KVCORE_MODEL) > config file > defaults, for every key of the
    config file, named as the field it fills (``None`` where nothing is given: EngineConfig / SamplingParams then
    apply their defaults)."""
    from kvcore.engine.file_config import empty_config, file_keys, load_config

    file_cfg = load_config(args.config) if getattr(args, "config", None) else empty_config()
    settings: dict[str, Any] = {}
    for key, d in file_keys().items():
        value = getattr(args, d.name, None)
        if value is None and d.name in ENVIRONMENT:
            value = os.environ.get(ENVIRONMENT[d.name]) or None
        if value is None:
            value = getattr(file_cfg, key)
        settings[d.name] = DEFAULTS.get(d.name) if value is None else value
    return settings


def with_piped_stdin(prompt: str | None, stdin=None) -> str | None:
    """``generate``'s prompt with text piped to standard input (a pipe or a file, not a terminal): the piped
    text alone when no prompt was given, else the piped text, a newline, then the prompt (as ``llm`` does)."""
    stdin = stdin or sys.stdin
    try:
        mode = os.fstat(stdin.fileno()).st_mode
    except (AttributeError, OSError, ValueError):  # closed, or not a real file (a test harness's stand-in)
        return prompt
    if not (stat.S_ISFIFO(mode) or stat.S_ISREG(mode)):
        return prompt
    piped = read_bounded_stdin(stdin).removesuffix("\n")
    if not piped:
        return prompt
    return piped if not prompt else f"{piped}\n{prompt}"


def read_prompt(args: argparse.Namespace, stdin=None) -> str | None:
    """The prompt of ``generate`` / ``chat``: the argument, all of standard input for ``-``, or the file of
    ``--prompt-file``; ``None`` when none was given."""
    stdin = stdin or sys.stdin
    prompt_file = getattr(args, "prompt_file", None)
    if prompt_file is not None and args.prompt is not None:
        raise ConfigError("give the prompt either as an argument or with --prompt-file, not both")
    if prompt_file is not None:
        text = read_bounded_text(prompt_file, "prompt file", MAX_PROMPT_BYTES)
        text = text.replace("\r\n", "\n").replace("\r", "\n")  # a CRLF file: the same prompt as an LF one
    elif args.prompt == "-":
        if stdin is None:
            raise ConfigError("prompt '-' reads standard input, which is closed")
        text = read_bounded_stdin(stdin)
    else:
        return args.prompt
    if not text.strip():
        raise InvalidRequestError("prompt is empty")
    return text.removesuffix("\n")  # the newline that ends a file or `echo` is not part of the prompt
