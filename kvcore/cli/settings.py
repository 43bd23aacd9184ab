"""Where a command's settings come from: flag > environment > config file > defaults; the prompt (argument,
``-`` for standard input, or ``--prompt-file``). The thread count is kvcore.engine.threads's, shared with the API."""

from __future__ import annotations

import argparse
import os
import stat
import sys
from typing import Any

from kvcore.errors import ConfigError, InvalidRequestError

__all__ = ["ENVIRONMENT", "DEFAULTS", "resolve_settings", "read_prompt", "with_piped_stdin"]

#: settings an environment variable may give (between flag and config file)
ENVIRONMENT = {"backend": "KVCORE_BACKEND", "model": "KVCORE_MODEL"}
#: defaults of the settings that have no default in EngineConfig / SamplingParams
DEFAULTS = {"model": "smollm2", "max_num_seqs": 1}


def resolve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Merge flag > environment (KVCORE_BACKEND, KVCORE_MODEL) > config file > defaults, for every key of the
    config file (``None`` where nothing is given: EngineConfig / SamplingParams then apply their defaults)."""
    from dataclasses import fields

    from kvcore.engine.file_config import OPTION_TABLES, FileConfig, load_config

    file_cfg = load_config(args.config) if getattr(args, "config", None) else FileConfig()
    settings: dict[str, Any] = {}
    for f in fields(FileConfig):
        name = f.name
        value = getattr(args, name, None)
        if value is None and name in ENVIRONMENT:
            value = os.environ.get(ENVIRONMENT[name]) or None
        if value is None:
            value = getattr(file_cfg, name)
        settings[name] = DEFAULTS.get(name) if value is None else value
    for table, option in OPTION_TABLES.items():
        settings[option] = settings.pop(table)
    settings["plugin_options"] = settings.pop("plugins")
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
    try:
        piped = stdin.read().removesuffix("\n")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"standard input is not UTF-8 text: {exc.reason}") from None
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
        try:
            with open(prompt_file, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as exc:
            raise ConfigError(f"prompt file '{prompt_file}' is not UTF-8 text: {exc.reason}") from None
        except OSError as exc:
            raise ConfigError(f"cannot read prompt file '{prompt_file}': {exc.strerror or exc}") from None
    elif args.prompt == "-":
        if stdin is None:
            raise ConfigError("prompt '-' reads standard input, which is closed")
        try:
            text = stdin.read()
        except UnicodeDecodeError as exc:
            raise ConfigError(f"standard input is not UTF-8 text: {exc.reason}") from None
    else:
        return args.prompt
    if not text.strip():
        raise InvalidRequestError("prompt is empty")
    return text.removesuffix("\n")  # the newline that ends a file or `echo` is not part of the prompt
