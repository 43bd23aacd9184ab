"""Chat templates: Jinja compiled in the sandboxed environment transformers uses, so they render identically."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvcore.errors import ConfigError

__all__ = ["TemplateRaised", "compile_template"]


class TemplateRaised(Exception):
    """``raise_exception(...)`` called from inside a chat template."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: unlike Jinja's built-in it does not HTML-escape, which templates rely on
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def compile_template(source: str) -> jinja2.Template:
    """``source`` compiled with transformers' globals (``raise_exception``, ``strftime_now``, ``tojson``);
    ConfigError when it is not valid Jinja."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ConfigError(f"the model's chat template is invalid Jinja: {exc}") from None
