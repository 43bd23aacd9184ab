"""Chat templates: Jinja compiled in the sandboxed environment transformers uses, so they render identically,
with a time limit and size limits, because the template comes from the model file.

Jinja's sandbox stops a template from reaching Python internals, but not from looping 10^10 times or
building a 1 GB string. :func:`render_template` bounds both:

* time: a watchdog thread raises :class:`ChatTemplateError` inside the rendering thread once
  :data:`RENDER_TIMEOUT_S` have passed (the compiled template is Python bytecode, so the exception lands
  at the next instruction);
* size: no string or list a template builds may exceed :data:`MAX_TEMPLATE_CHARS` elements. The checks
  sit where a template can amplify: the ``*``, ``+``, ``%`` and ``**`` operators, every call (arguments,
  and the padding widths of ``str`` methods), the padding / joining filters, ``namespace`` assignments,
  and the rendered output, counted as it streams.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Iterable, Sized
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from kvcore.errors import ChatTemplateError, KVCoreError
from kvcore.text.watchdog import Watchdog

__all__ = ["TemplateRaised", "compile_template", "render_template", "RENDER_TIMEOUT_S", "MAX_TEMPLATE_CHARS"]

#: wall-clock seconds one rendering may take (real templates take milliseconds)
RENDER_TIMEOUT_S = 5.0
#: longest string / list a template may build, and longest rendered prompt, in characters (elements)
MAX_TEMPLATE_CHARS = 8 * 1024 * 1024
#: ``str`` methods and filters whose integer arguments are output widths
_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "indent", "wordwrap"})


class TemplateRaised(Exception):
    """``raise_exception(...)`` called from inside a chat template."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _too_big(what: str, size: int) -> ChatTemplateError:
    return ChatTemplateError(
        f"the model's chat template {what} of {size} characters (limit {MAX_TEMPLATE_CHARS}); is it hostile?"
    )


def _size(value: object) -> int:
    return len(value) if isinstance(value, (str, list, tuple, dict)) else 0


def _check_value(value: object, what: str) -> None:
    if _size(value) > MAX_TEMPLATE_CHARS:
        raise _too_big(what, _size(value))


def _check_widths(name: str, args: tuple, kwargs: dict) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_TEMPLATE_CHARS:
            raise _too_big(f"asks {name} for a width", value)


#: a ``%`` conversion's width and precision (``%-10.3f``, ``%(name)5s``)
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d*)(?:\.(\*|\d*))?")
_DIGITS = re.compile(r"\d+")


def _check_widths_in(numbers: Iterable[str]) -> None:
    for digits in numbers:
        # compare lengths first: int() of a 5000-digit run would itself be slow (and refused)
        if digits and (len(digits) > 9 or int(digits) > MAX_TEMPLATE_CHARS):
            raise _too_big("formats a field to a width", int(digits[:12]))


def _check_percent_format(spec: str, args: object) -> None:
    """Widths and precisions of ``spec % args`` (literal digits elsewhere in the text are no widths); a
    ``*`` takes them from ``args``."""
    numbers = [n for m in _PERCENT_FIELD.finditer(spec) for n in m.groups() if n]
    _check_widths_in(n for n in numbers if n != "*")
    if "*" in numbers:
        _check_widths("a '*' width", args if isinstance(args, tuple) else (args,), {})


def _check_str_format(spec: str, args: tuple, kwargs: dict) -> None:
    """Widths and precisions in the replacement fields of ``spec.format(*args, **kwargs)``; a nested field
    (``{0:{1}}``) takes them from the arguments."""
    try:
        fields = [f[2] for f in string.Formatter().parse(spec) if f[2]]
    except ValueError:
        return  # malformed: str.format itself raises
    _check_widths_in(n for f in fields for n in _DIGITS.findall(f))
    if any("{" in f for f in fields):
        _check_widths("a nested format width", args, kwargs)


def _check_binop(operator: str, left: object, right: object) -> None:
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            if isinstance(count, int) and _size(seq) * count > MAX_TEMPLATE_CHARS:
                raise _too_big("repeats a value to a size", _size(seq) * count)
    elif operator == "+" and _size(left) + _size(right) > MAX_TEMPLATE_CHARS:
        raise _too_big("concatenates values to a size", _size(left) + _size(right))
    elif operator == "%" and isinstance(left, str):
        _check_percent_format(left, right)
    elif operator == "**" and isinstance(right, (int, float)) and abs(right) > 1024:
        raise ChatTemplateError(f"the model's chat template raises to the power {right} (limit 1024)")


class _BoundedNamespace(Namespace):
    """``namespace()`` whose attributes stay within the size limit (a loop can grow one without bound)."""

    def __setitem__(self, name: str, value: object) -> None:
        _check_value(value, f"stores in namespace attribute '{name}' a value")
        super().__setitem__(name, value)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with the size checks of the module docstring on operators and calls."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: object, right: object) -> Any:
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(self, context: jinja2.runtime.Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            _check_value(value, "passes a value")
        owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
        wrapped = getattr(getattr(obj, "__wrapped__", None), "__self__", None)  # the sandbox's str.format
        if isinstance(wrapped, str) and name in ("format", "format_map"):
            mapping = args[0] if name == "format_map" and args and isinstance(args[0], dict) else kwargs
            _check_str_format(wrapped, args if name == "format" else (), mapping)
        if isinstance(owner, str):
            if name in _WIDTH_METHODS:
                _check_widths(f"str.{name}", args, kwargs)
            elif name == "join" and args and isinstance(args[0], Sized):
                if len(owner) * len(args[0]) > MAX_TEMPLATE_CHARS:
                    raise _too_big("joins to a size", len(owner) * len(args[0]))
        return super().call(context, obj, *args, **kwargs)

    def wrap_str_format(self, value: object) -> Any:
        # the sandbox replaces ``str.format`` / ``format_map`` at attribute access: check the spec there
        if isinstance(getattr(value, "__self__", None), str) and getattr(value, "__name__", "") in (
            "format", "format_map"
        ):
            _check_str_format(value.__self__, (), {})
        return super().wrap_str_format(value)


def _bounded_filter(name: str, inner: Any) -> Any:
    passes_context = hasattr(inner, "jinja_pass_arg")  # then args[0] is Jinja's context, not the value

    def checked(*all_args: Any, **kwargs: Any) -> Any:
        args = all_args[1:] if passes_context else all_args
        if name in _WIDTH_METHODS or name == "tojson":
            _check_widths(f"the '{name}' filter", args[1:], kwargs)
        elif name == "format" and args and isinstance(args[0], str):
            _check_percent_format(args[0], args[1:] or kwargs)  # Jinja's format filter is ``value % args``
        elif name == "join" and args and isinstance(args[0], Sized):
            sep = args[1] if len(args) > 1 else kwargs.get("d", "")
            if _size(sep) * len(args[0]) > MAX_TEMPLATE_CHARS:
                raise _too_big("joins to a size", _size(sep) * len(args[0]))
        elif name == "replace" and len(args) >= 3 and all(isinstance(a, str) for a in args[:3]):
            s, old, new = args[:3]
            grown = len(s) + (s.count(old) if old else len(s) + 1) * max(len(new) - len(old), 0)
            if grown > MAX_TEMPLATE_CHARS:
                raise _too_big("replaces to a size", grown)
        return inner(*all_args, **kwargs)

    for attr in ("jinja_pass_arg",):  # keep @pass_context / @pass_environment markers
        if hasattr(inner, attr):
            setattr(checked, attr, getattr(inner, attr))
    return checked


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
    ChatTemplateError (a ConfigError) when it is not valid Jinja. Render it with :func:`render_template`."""
    if len(source) > MAX_TEMPLATE_CHARS:
        raise _too_big("is a source", len(source))
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    for name in (*_WIDTH_METHODS, "tojson", "format", "join", "replace"):
        if name in env.filters:
            env.filters[name] = _bounded_filter(name, env.filters[name])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _BoundedNamespace
    try:
        return env.from_string(source)
    except (jinja2.TemplateError, RecursionError, MemoryError) as exc:
        raise ChatTemplateError(f"the model's chat template is invalid Jinja: {exc}") from None


def render_template(template: jinja2.Template, timeout_s: float = RENDER_TIMEOUT_S, **variables: Any) -> str:
    """``template`` rendered with ``variables``, within ``timeout_s`` and :data:`MAX_TEMPLATE_CHARS`.

    Raises ChatTemplateError when a limit is hit or the template recurses too deeply; TemplateRaised
    and jinja2.TemplateError pass through for the caller to classify.
    """
    timeout = ChatTemplateError(f"the model's chat template did not finish rendering in {timeout_s:g} s")
    watchdog = Watchdog(timeout, timeout_s)
    try:
        with watchdog:
            parts, size = [], 0
            for chunk in template.generate(**variables):
                size += len(chunk)
                if size > MAX_TEMPLATE_CHARS:
                    raise _too_big("renders a prompt", size)
                parts.append(chunk)
            return "".join(parts)
    except (TemplateRaised, jinja2.TemplateError, KVCoreError):
        raise
    except RecursionError:
        raise ChatTemplateError("the model's chat template recursed too deeply") from None
    except MemoryError:
        raise ChatTemplateError("the model's chat template ran out of memory") from None
    except Exception as exc:  # the template is code from the model file: any failure is the template's
        raise ChatTemplateError(f"the model's chat template failed: {type(exc).__name__}: {exc}") from None
