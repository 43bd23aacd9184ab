"""OpenAI request bodies → kvcore requests, with OpenAI's validation rules and error shape.

A request body is a JSON object; :func:`parse_completion` and :func:`parse_chat` check every field the
server understands and raise :class:`~kvcore.errors.InvalidRequestError` (→ HTTP 400) naming the field.
Fields OpenAI defines but kvcore cannot honour (``suffix``, ``audio``, ...) are refused rather than silently
ignored. Structured output comes as OpenAI's ``response_format`` or vLLM's ``guided_*`` / ``structured_outputs``
fields (:func:`structured_output`). Unknown fields are ignored and listed in ``GenerationJob.ignored_fields``
(the server logs them and names them in a response header, as vLLM logs them), or refused with ``strict``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvcore.errors import ContextLengthError, InvalidRequestError
from kvcore.interfaces.sampler import MAX_LOGPROBS, SamplingParams
from kvcore.interfaces.structured import StructuredOutput
from kvcore.serving.tools import ToolRequest, parse_tools

__all__ = [
    "GenerationJob", "parse_completion", "parse_chat", "parse_tokenize", "parse_detokenize", "structured_output",
    "error_body", "usage", "MAX_N", "max_prompt_chars", "max_body_bytes",
]

#: most choices one request may ask for (n × number of prompts)
MAX_N = 16
#: OpenAI's limit on stop sequences
MAX_STOP = 4
#: headroom on "characters per token" for normalisers (NFC/NFKC) that merge code points before tokenising
CHARS_PER_TOKEN_SLACK = 4
#: bytes JSON may spend on one character of a string (``\uXXXX``)
JSON_BYTES_PER_CHAR = 6


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """Characters past which a prompt cannot fit into ``max_model_len`` tokens: no token covers more
    than ``tokenizer.max_token_chars`` of them. Longer prompts are refused before they are tokenised."""
    return max_model_len * tokenizer.max_token_chars * CHARS_PER_TOKEN_SLACK


def max_body_bytes(prompt_chars: int, vocab_size: int) -> int:
    """The largest request body a request this model can run may need: :data:`MAX_N` prompts of
    ``prompt_chars`` characters as JSON may escape them, a ``logit_bias`` over the whole vocabulary
    and room for the other fields. A longer body is refused before it is parsed."""
    return MAX_N * prompt_chars * JSON_BYTES_PER_CHAR + vocab_size * 32 + (1 << 20)


@dataclass(frozen=True)
class GenerationJob:
    """One HTTP request as engine work: each prompt (token ids) is sampled ``params.n`` times; choice
    ``p * n + i`` is sample ``i`` of prompt ``p`` (OpenAI's order)."""

    model: str | None
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    echo: bool = False  # completions: return the prompt before the completion
    prompt_texts: tuple[str | None, ...] = ()  # completions: each prompt as the client wrote it (None: token ids)
    want_logprobs: bool = False  # chat logprobs=true / completions logprobs set
    ignored_fields: tuple[str, ...] = ()  # body fields the server does not know (ignored unless strict)
    tools: ToolRequest | None = None  # chat: the tools the model may call (kvcore/serving/tools.py)
    structured_field: str | None = None  # the body field that asked for structured output (errors name it)


def error_body(message: str, err_type: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None = None) -> dict:
    out = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }
    if num_cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return out


# -- field readers: each raises InvalidRequestError naming the field ------------------------------------
def _bad(name: str, what: str, value: Any) -> InvalidRequestError:
    exc = InvalidRequestError(f"'{name}' must be {what}, got {value!r}")
    exc.param = name  # type: ignore[attr-defined]
    return exc


def _number(body: Mapping, name: str, default: float | None, lo: float = -math.inf, hi: float = math.inf):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(name, "a number", value)
    if not lo <= value <= hi:
        raise _bad(name, f"in [{lo}, {hi}]", value)
    return float(value)


def _int(body: Mapping, name: str, default: int | None, lo: int | None = None, hi: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, "an integer", value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _bad(name, f"an integer in [{lo}, {hi if hi is not None else '∞'}]", value)
    return value


def _bool(body: Mapping, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, "true or false", value)
    return value


def _refuse(body: Mapping, name: str, why: str, allowed: Any = None) -> None:
    value = body.get(name)
    if value is not None and value != allowed and value != [] and value != {}:
        exc = InvalidRequestError(f"'{name}' is not supported: {why}")
        exc.param = name  # type: ignore[attr-defined]
        raise exc


def _stop(body: Mapping) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise _bad("stop", f"a non-empty string or a list of at most {MAX_STOP} of them", value)
    return tuple(stops)


def _token_ids(body: Mapping, name: str, vocab_size: int) -> tuple[int, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise _bad(name, "a list of integer token ids", value)
    return tuple(_int({name: t}, name, 0, 0, vocab_size - 1) for t in value)


def _cache_salt(body: Mapping) -> str | None:
    value = body.get("cache_salt")
    if value is not None and not (isinstance(value, str) and value):
        raise _bad("cache_salt", "a non-empty string", value)
    return value


def _logit_bias(body: Mapping, vocab_size: int) -> dict[int, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _bad("logit_bias", "an object mapping token ids to biases in [-100, 100]", value)
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise _bad("logit_bias", "an object whose keys are token ids", key) from None
        if not 0 <= token < vocab_size:
            raise _bad("logit_bias", f"keyed by token ids in [0, {vocab_size})", token)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise _bad("logit_bias", "an object of biases in [-100, 100]", bias)
        out[token] = float(bias)
    return out


def _stream_options(body: Mapping, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise _bad("stream_options", "given only together with stream=true", options)
    if not isinstance(options, Mapping):
        raise _bad("stream_options", "an object", options)
    return _bool(options, "include_usage", False)


#: fields every generation endpoint reads (OpenAI's ``user`` is accepted and has no effect)
_COMMON_FIELDS = frozenset({
    "model", "max_tokens", "n", "best_of", "min_tokens", "top_k", "temperature", "top_p", "min_p", "seed", "stop",
    "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos",
    "stream", "stream_options", "logprobs", "user", "response_format", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "structured_outputs",
})
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "suffix", "echo"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                                "parallel_tool_calls", "functions", "audio"}


def _unknown_fields(body: Mapping, known: frozenset[str], strict: bool) -> tuple[str, ...]:
    unknown = tuple(sorted(k for k in body if k not in known))
    if unknown and strict:
        exc = InvalidRequestError(f"unknown request field{'s' * (len(unknown) > 1)}: {', '.join(unknown)} "
                                  "(the server runs with --strict)")
        exc.param = unknown[0]  # type: ignore[attr-defined]
        raise exc
    return unknown


def _with_param(exc: InvalidRequestError, name: str) -> InvalidRequestError:
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
                raise _bad("response_format", "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}",
                           fmt)
            found.append(("response_format", {"json": dict(spec["schema"])}))
        elif kind != "text":
            raise _bad("response_format", "an object whose type is 'text', 'json_object' or 'json_schema'", fmt)
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if body.get(name) is not None:
            found.append((name, {key: body[name]}))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, Mapping):
            raise _bad("structured_outputs", "an object with one of json, regex, choice, grammar, json_object", so)
        keys = {k: v for k, v in so.items() if k in ("json", "regex", "choice", "grammar", "json_object") and v}
        found.append(("structured_outputs", keys))
    if not found:
        return None
    if len(found) > 1:
        raise _with_param(InvalidRequestError(
            f"give one structured-output field, not {' and '.join(n for n, _ in found)}"), found[1][0])
    name, spec = found[0]
    if "choice" in spec and not isinstance(spec["choice"], list):
        raise _bad(name, "a list of strings", spec["choice"])
    try:
        return StructuredOutput(**spec)
    except InvalidRequestError as exc:
        raise _with_param(type(exc)(f"'{name}': {exc}"), name) from None


def _params(body: Mapping, *, max_tokens: int, logprobs: int | None, vocab_size: int,
            structured: StructuredOutput | None) -> SamplingParams:
    """The sampling fields shared by both endpoints (OpenAI's defaults: temperature 1, top_p 1)."""
    n = _int(body, "n", 1, 1, MAX_N)
    best_of = _int(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of != n:
        raise _bad("best_of", f"equal to n ({n}); ranking extra samples is not supported", best_of)
    _refuse(body, "min_tokens", "kvcore has no minimum length; use ignore_eos", allowed=0)
    top_k = _int(body, "top_k", 0, -1)
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1e-9,  # top_p 0 keeps only the top token (greedy)
        top_k=0 if top_k == -1 else top_k,  # vLLM spells "off" as -1
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        seed=_int(body, "seed", None, -(2**63), 2**64 - 1),
        n=n,
        stop=_stop(body),
        stop_token_ids=_token_ids(body, "stop_token_ids", vocab_size),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 1e-6, math.inf),
        logit_bias=_logit_bias(body, vocab_size),
        logprobs=logprobs,
        ignore_eos=_bool(body, "ignore_eos", False),
        cache_salt=_cache_salt(body),
        structured_output=structured,
    )


def _check_chars(num_chars: int, limit: int, what: str) -> None:
    if num_chars > limit:
        raise ContextLengthError(
            f"{what} has {num_chars} characters; no text longer than {limit} characters fits this model's "
            "context window; shorten it"
        )


def _max_tokens(requested: int | None, prompt_lens: list[int], max_model_len: int) -> int:
    longest = max(prompt_lens)
    if longest >= max_model_len:
        raise ContextLengthError(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has {longest} "
            "tokens and no room is left to generate; shorten the prompt"
        )
    # No max_tokens: as much as the context window leaves (vLLM's rule for chat).
    return requested if requested is not None else max_model_len - longest


def parse_completion(
    body: Mapping, tokenizer: Any, *, vocab_size: int, max_model_len: int, max_prompt_chars: int, strict: bool = False
) -> GenerationJob:
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, token ids, or a list of those.
    A prompt that cannot fit ``max_model_len`` is refused from its length, before it is tokenised.
    ``strict``: an unknown field is a 400 instead of being ignored."""
    ignored = _unknown_fields(body, COMPLETION_FIELDS, strict)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        raw = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raw = prompt
    else:
        raise _bad("prompt", "a string, a list of strings, a list of token ids, or a list of such lists", prompt)
    if len(raw) > MAX_N:
        raise _bad("prompt", f"at most {MAX_N} prompts", f"{len(raw)} prompts")
    prompts = []
    for p in raw:
        if isinstance(p, str):
            if not p:
                raise _bad("prompt", "non-empty", p)
            _check_chars(len(p), max_prompt_chars, "the prompt")
            prompts.append(tokenizer.encode(p))
        elif p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            _max_tokens(None, [len(p)], max_model_len)  # before the scan below walks a list of any length
            bad = [t for t in p if not 0 <= t < vocab_size]
            if bad:
                raise _bad("prompt", f"made of token ids in [0, {vocab_size})", bad[0])
            prompts.append(list(p))
        else:
            raise _bad("prompt", "a non-empty list of integer token ids", p)
    _refuse(body, "suffix", "kvcore does not do fill-in-the-middle")
    stream = _bool(body, "stream", False)
    echo = _bool(body, "echo", False)
    logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    if echo and logprobs is not None:
        raise InvalidRequestError("'echo' together with 'logprobs' is not supported (no prompt logprobs)")
    # OpenAI's legacy default for completions is 16 tokens.
    max_tokens = _max_tokens(_int(body, "max_tokens", 16, 1), [len(p) for p in prompts], max_model_len)
    params = _params(body, max_tokens=max_tokens, logprobs=logprobs, vocab_size=vocab_size,
                     structured=structured_output(body))
    if len(prompts) * params.n > MAX_N:
        raise _bad("n", f"at most {MAX_N} choices in all (prompts × n)", len(prompts) * params.n)
    return GenerationJob(
        model=body.get("model"),
        prompts=prompts,
        params=params,
        stream=stream,
        include_usage=_stream_options(body, stream),
        echo=echo,
        prompt_texts=tuple(p if isinstance(p, str) else None for p in raw),
        want_logprobs=logprobs is not None,
        ignored_fields=ignored,
        structured_field=structured_field(body),
    )


def _message_text(message: Mapping, i: int) -> dict[str, Any]:
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise _bad(f"messages[{i}].role", "a non-empty string", role)
    content = message.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):  # content parts: only text can be fed to a text model
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content", "a string or a list of {'type': 'text', 'text': ...} parts", part)
            texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise _bad(f"messages[{i}].content", "a string or a list of text parts", content)
    out: dict[str, Any] = {"role": role, "content": content}
    calls = message.get("tool_calls")
    if calls:  # an assistant turn that called tools: templates read the arguments as an object
        if not isinstance(calls, list) or not all(isinstance(c, Mapping) and isinstance(c.get("function"), Mapping)
                                                  for c in calls):
            raise _bad(f"messages[{i}].tool_calls", "a list of {'function': {'name', 'arguments'}} objects", calls)
        out["tool_calls"] = [_call_for_template(c, i) for c in calls]
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _call_for_template(call: Mapping, i: int) -> dict[str, Any]:
    fn = call["function"]
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise _bad(f"messages[{i}].tool_calls", "calls whose arguments are a JSON object", args) from None
    function = {"name": fn.get("name"), "arguments": args}
    return {"id": call.get("id"), "type": "function", "function": function, **function}


def parse_chat(
    body: Mapping, tokenizer: Any, *, vocab_size: int, max_model_len: int, max_prompt_chars: int, strict: bool = False
) -> GenerationJob:
    """``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template (with ``tools``
    when given); messages that cannot fit ``max_model_len`` are refused from their length, before rendering
    and tokenising. ``strict``: an unknown field is a 400 instead of being ignored."""
    ignored = _unknown_fields(body, CHAT_FIELDS, strict)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
        raise _bad("messages", "a non-empty list of message objects", messages)
    _refuse(body, "functions", "use 'tools'")
    _refuse(body, "audio", "text only")
    tools = parse_tools(body, tokenizer)
    structured = structured_output(body)
    if tools is not None and structured is not None:
        raise _with_param(InvalidRequestError("'tools' cannot be combined with a structured-output field"), "tools")
    texts = [_message_text(m, i) for i, m in enumerate(messages)]
    size = sum(len(str(m.get("role") or "")) + len(str(m.get("content") or "")) for m in texts)
    _check_chars(size, max_prompt_chars, "the conversation")
    text = tokenizer.apply_chat_template(texts, add_generation_prompt=True, tools=list(tools.tools) if tools else None)
    prompt_ids = tokenizer.encode(text, add_bos=False)  # the template writes its own BOS
    stream = _bool(body, "stream", False)
    want_logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise _bad("top_logprobs", "given only together with logprobs=true", top)
    requested = _int(body, "max_completion_tokens", None, 1)
    if requested is None:
        requested = _int(body, "max_tokens", None, 1)
    params = _params(
        body,
        max_tokens=_max_tokens(requested, [len(prompt_ids)], max_model_len),
        logprobs=(top or 0) if want_logprobs else None,
        vocab_size=vocab_size,
        structured=tools.constraint() if tools is not None else structured,
    )
    return GenerationJob(
        model=body.get("model"),
        prompts=[prompt_ids],
        params=params,
        stream=stream,
        include_usage=_stream_options(body, stream),
        want_logprobs=want_logprobs,
        ignored_fields=ignored,
        tools=tools,
        structured_field=structured_field(body),
    )


def parse_tokenize(body: Mapping, tokenizer: Any) -> list[int]:
    """``POST /tokenize`` (vLLM's): ``prompt`` (text; ``add_special_tokens`` adds the BOS the model wants) or
    chat ``messages`` (rendered with the chat template; ``add_generation_prompt``, default true)."""
    if body.get("messages") is not None:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise _bad("messages", "a list of message objects", messages)
        text = tokenizer.apply_chat_template([_message_text(m, i) for i, m in enumerate(messages)],
                                             add_generation_prompt=_bool(body, "add_generation_prompt", True))
        return tokenizer.encode(text, add_bos=False)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise _bad("prompt", "a string (or give 'messages')", prompt)
    return tokenizer.encode(prompt, add_bos=None if _bool(body, "add_special_tokens", True) else False)


def parse_detokenize(body: Mapping, vocab_size: int) -> list[int]:
    """``POST /detokenize`` (vLLM's): ``tokens``, a list of token ids."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise _bad("tokens", "a list of token ids", tokens)
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise _bad("tokens", f"token ids in [0, {vocab_size})", bad[0])
    return tokens
