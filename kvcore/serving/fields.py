"""Reading the fields of an OpenAI request body: each value checked, with a 400 that names the field;
the fields each endpoint knows, and the structured-output fields (OpenAI's ``response_format``, vLLM's
``guided_*`` and ``structured_outputs``)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvcore.errors import InvalidRequestError
from kvcore.interfaces.structured import StructuredOutput

__all__ = [
    "CHAT_FIELDS", "COMMON_FIELDS", "COMPLETION_FIELDS", "MAX_STOP", "bad_field", "bool_field",
    "cache_salt_field", "int_field", "logit_bias_field", "number_field", "refuse_field", "stop_field",
    "stream_options_field", "structured_field", "structured_output", "token_ids_field", "unknown_fields",
    "field_names", "with_param", "message_text", "call_for_template",
]

#: OpenAI's limit on stop sequences
MAX_STOP = 4


def bad_field(name: str, what: str, value: object) -> InvalidRequestError:
    exc = InvalidRequestError(f"'{name}' must be {what}, got {value!r}")
    exc.param = name  # type: ignore[attr-defined]
    return exc


def number_field(body: Mapping, name: str, default: float | None, lo: float = -math.inf, hi: float = math.inf):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_field(name, "a number", value)
    if not lo <= value <= hi:
        raise bad_field(name, f"in [{lo}, {hi}]", value)
    return float(value)


def int_field(body: Mapping, name: str, default: int | None, lo: int | None = None, hi: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_field(name, "an integer", value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise bad_field(name, f"an integer in [{lo}, {hi if hi is not None else '∞'}]", value)
    return value


def bool_field(body: Mapping, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_field(name, "true or false", value)
    return value


def refuse_field(body: Mapping, name: str, why: str, allowed: object = None) -> None:
    value = body.get(name)
    if value is not None and value != allowed and value != [] and value != {}:
        exc = InvalidRequestError(f"'{name}' is not supported: {why}")
        exc.param = name  # type: ignore[attr-defined]
        raise exc


def stop_field(body: Mapping) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise bad_field("stop", f"a non-empty string or a list of at most {MAX_STOP} of them", value)
    return tuple(stops)


def token_ids_field(body: Mapping, name: str, vocab_size: int) -> tuple[int, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad_field(name, "a list of integer token ids", value)
    return tuple(int_field({name: t}, name, 0, 0, vocab_size - 1) for t in value)


def cache_salt_field(body: Mapping) -> str | None:
    value = body.get("cache_salt")
    if value is not None and not (isinstance(value, str) and value):
        raise bad_field("cache_salt", "a non-empty string", value)
    return value


def logit_bias_field(body: Mapping, vocab_size: int) -> dict[int, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise bad_field("logit_bias", "an object mapping token ids to biases in [-100, 100]", value)
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad_field("logit_bias", "an object whose keys are token ids", key) from None
        if not 0 <= token < vocab_size:
            raise bad_field("logit_bias", f"keyed by token ids in [0, {vocab_size})", token)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad_field("logit_bias", "an object of biases in [-100, 100]", bias)
        out[token] = float(bias)
    return out


def stream_options_field(body: Mapping, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad_field("stream_options", "given only together with stream=true", options)
    if not isinstance(options, Mapping):
        raise bad_field("stream_options", "an object", options)
    return bool_field(options, "include_usage", False)


#: fields every generation endpoint reads (OpenAI's ``user`` is accepted and has no effect)
COMMON_FIELDS = frozenset({
    "model", "max_tokens", "n", "best_of", "min_tokens", "top_k", "temperature", "top_p", "min_p", "seed", "stop",
    "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "repetition_window",
    "logit_bias", "ignore_eos", "cache_salt", "stream", "stream_options", "logprobs", "user", "response_format",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"
})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "suffix", "echo"}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages",
    "top_logprobs",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "audio",
}


#: unknown field names a log line, a header or an error message shows: at most this many, each cut to
#: :data:`MAX_SHOWN_NAME_CHARS` characters (a client chooses them; a body may hold thousands)
MAX_SHOWN_NAMES, MAX_SHOWN_NAME_CHARS = 16, 64


def field_names(names: Sequence[str]) -> str:
    """Client-chosen field names as one printable ASCII line (``a, b\\n, c``): control characters, backslashes and
    non-ASCII written as Python escapes, so a name can neither forge a log line nor break a response header;
    long names and long lists are cut, saying how many there were."""
    shown = []
    for name in names[:MAX_SHOWN_NAMES]:
        text = name.encode("unicode_escape").decode("ascii")
        shown.append(text if len(text) <= MAX_SHOWN_NAME_CHARS else text[: MAX_SHOWN_NAME_CHARS - 3] + "...")
    more = len(names) - len(shown)
    return ", ".join(shown + ([f"and {more} more"] if more > 0 else []))


def unknown_fields(body: Mapping, known: frozenset[str], strict: bool) -> tuple[str, ...]:
    unknown = tuple(sorted(k for k in body if k not in known))
    if unknown and strict:
        exc = InvalidRequestError(
            f"unknown request field{'s' * (len(unknown) > 1)}: {field_names(unknown)} (the server runs with --strict)"
        )
        exc.param = unknown[0]  # type: ignore[attr-defined]
        raise exc
    return unknown


def with_param(exc: InvalidRequestError, name: str) -> InvalidRequestError:
    exc.param = name  # type: ignore[attr-defined]
    return exc


def structured_field(body: Mapping) -> str | None:
    """The field :func:`structured_output` read its constraint from (``tools`` for tool calls)."""
    fmt = body.get("response_format")
    if isinstance(fmt, Mapping) and fmt.get("type") in ("json_object", "json_schema"):
        return "response_format"
    names = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "tools")
    return next((n for n in names if body.get(n)), None)


def structured_output(body: Mapping) -> StructuredOutput | None:
    """The constraint a body asks for: OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's
    ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, or vLLM's newer
    ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``); at most one."""
    found: list[tuple[str, dict]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, Mapping) else None
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
                raise bad_field(
                    "response_format", "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}", fmt
                )
            found.append(("response_format", {"json": dict(spec["schema"])}))
        elif kind != "text":
            raise bad_field("response_format", "an object whose type is 'text', 'json_object' or 'json_schema'", fmt)
    for name, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        if body.get(name) is not None:
            found.append((name, {key: body[name]}))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, Mapping):
            raise bad_field("structured_outputs", "an object with one of json, regex, choice, grammar, json_object", so)
        keys = {k: v for k, v in so.items() if k in ("json", "regex", "choice", "grammar", "json_object") and v}
        found.append(("structured_outputs", keys))
    if not found:
        return None
    if len(found) > 1:
        raise with_param(
            InvalidRequestError(f"give one structured-output field, not {' and '.join(n for n, _ in found)}"),
            found[1][0],
        )
    name, spec = found[0]
    if "choice" in spec and not isinstance(spec["choice"], list):
        raise bad_field(name, "a list of strings", spec["choice"])
    try:
        return StructuredOutput(**spec)
    except InvalidRequestError as exc:
        raise with_param(type(exc)(f"'{name}': {exc}"), name) from None


def message_text(message: Mapping, i: int) -> dict[str, Any]:
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise bad_field(f"messages[{i}].role", "a non-empty string", role)
    content = message.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):  # content parts: only text can be fed to a text model
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_field(
                    f"messages[{i}].content", "a string or a list of {'type': 'text', 'text': ...} parts", part
                )
            texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise bad_field(f"messages[{i}].content", "a string or a list of text parts", content)
    out: dict[str, Any] = {"role": role, "content": content}
    calls = message.get("tool_calls")
    if calls:  # an assistant turn that called tools: templates read the arguments as an object
        if not isinstance(calls, list) or not all(
            isinstance(c, Mapping) and isinstance(c.get("function"), Mapping) for c in calls
        ):
            raise bad_field(f"messages[{i}].tool_calls", "a list of {'function': {'name', 'arguments'}} objects", calls)
        out["tool_calls"] = [call_for_template(c, i) for c in calls]
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def call_for_template(call: Mapping, i: int) -> dict[str, Any]:
    fn = call["function"]
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise bad_field(f"messages[{i}].tool_calls", "calls whose arguments are a JSON object", args) from None
    function = {"name": fn.get("name"), "arguments": args}
    return {"id": call.get("id"), "type": "function", "function": function, **function}
