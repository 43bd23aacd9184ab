"""OpenAI request bodies → kvcore requests, with OpenAI's validation rules and error shape.

A request body is a JSON object; :func:`parse_completion` and :func:`parse_chat` check every field the
server understands and raise :class:`~kvcore.errors.InvalidRequestError` (→ HTTP 400) naming the field.
Fields OpenAI defines but kvcore cannot honour (``suffix``, ``audio``, ...) are refused rather than silently
ignored. Structured output comes as OpenAI's ``response_format`` or vLLM's ``guided_*`` / ``structured_outputs``
fields (:func:`structured_output`). Unknown fields are ignored and listed in ``GenerationJob.ignored_fields``
(the server logs them and names them in a response header, as vLLM logs them), or refused with ``strict``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvcore.errors import ContextLengthError, InvalidRequestError
from kvcore.interfaces.sampler import MAX_LOGPROBS, SamplingParams
from kvcore.interfaces.structured import StructuredOutput
from kvcore.sampling.chat_defaults import OPENAI_DEFAULTS, chat_defaults
from kvcore.serving.fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    bad_field,
    bool_field,
    cache_salt_field,
    int_field,
    logit_bias_field,
    message_text,
    number_field,
    refuse_field,
    stop_field,
    stream_options_field,
    structured_field,
    structured_output,
    token_ids_field,
    unknown_fields,
    with_param,
)
from kvcore.serving.tools import ToolRequest, parse_tools
from kvcore.text.tokenizer import Tokenizer

__all__ = [
    "GenerationJob", "parse_completion", "parse_chat", "parse_tokenize", "parse_detokenize", "structured_output",
    "error_body", "usage", "MAX_N", "max_prompt_chars", "max_body_bytes",
]

#: most choices one request may ask for (n × number of prompts)
MAX_N = 16
#: headroom on "characters per token" for normalisers (NFC/NFKC) that merge code points before tokenising
CHARS_PER_TOKEN_SLACK = 4
#: bytes JSON may spend on one character of a string (``\uXXXX``)
JSON_BYTES_PER_CHAR = 6


def max_prompt_chars(tokenizer: Tokenizer, max_model_len: int) -> int:
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
def _params(body: Mapping, *, max_tokens: int, logprobs: int | None, vocab_size: int,
            structured: StructuredOutput | None, unset: Mapping[str, Any] = OPENAI_DEFAULTS) -> SamplingParams:
    """The sampling fields shared by both endpoints; ``unset``: the values of those a request leaves unset."""
    n = int_field(body, "n", 1, 1, MAX_N)
    best_of = int_field(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of != n:
        raise bad_field("best_of", f"equal to n ({n}); ranking extra samples is not supported", best_of)
    refuse_field(body, "min_tokens", "kvcore has no minimum length; use ignore_eos", allowed=0)
    top_k = int_field(body, "top_k", unset["top_k"], -1)
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=number_field(body, "temperature", unset["temperature"], 0.0, 2.0),
        top_p=number_field(body, "top_p", unset["top_p"], 0.0, 1.0) or 1e-9,  # top_p 0 keeps only the top token
        top_k=0 if top_k == -1 else top_k,  # vLLM spells "off" as -1
        min_p=number_field(body, "min_p", unset["min_p"], 0.0, 1.0),
        seed=int_field(body, "seed", None, -(2**63), 2**64 - 1),
        n=n,
        stop=stop_field(body),
        stop_token_ids=token_ids_field(body, "stop_token_ids", vocab_size),
        presence_penalty=number_field(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=number_field(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=number_field(body, "repetition_penalty", unset["repetition_penalty"], 1e-6, math.inf),
        repetition_window=int_field(body, "repetition_window", unset["repetition_window"], 1),
        logit_bias=logit_bias_field(body, vocab_size),
        logprobs=logprobs,
        ignore_eos=bool_field(body, "ignore_eos", False),
        cache_salt=cache_salt_field(body),
        structured_output=structured,
    )


def _check_chars(num_chars: int, limit: int, what: str) -> None:
    if num_chars > limit:
        raise ContextLengthError(f"{what} has {num_chars} characters; no text longer than {limit} characters fits "
                                 "this model's context window; shorten it")


def _check_conversation(messages: list[Mapping], limit: int) -> None:
    """Chat messages (as :func:`message_text` returns them) refused from their length, before templating."""
    size = sum(len(str(m.get("role") or "")) + len(str(m.get("content") or "")) for m in messages)
    _check_chars(size, limit, "the conversation")


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
    ignored = unknown_fields(body, COMPLETION_FIELDS, strict)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        raw = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raw = prompt
    else:
        raise bad_field("prompt", "a string, a list of strings, a list of token ids, or a list of such lists", prompt)
    if len(raw) > MAX_N:
        raise bad_field("prompt", f"at most {MAX_N} prompts", f"{len(raw)} prompts")
    prompts = []
    for p in raw:
        if isinstance(p, str):
            if not p:
                raise bad_field("prompt", "non-empty", p)
            _check_chars(len(p), max_prompt_chars, "the prompt")
            prompts.append(tokenizer.encode(p))
        elif p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            _max_tokens(None, [len(p)], max_model_len)  # before the scan below walks a list of any length
            bad = [t for t in p if not 0 <= t < vocab_size]
            if bad:
                raise bad_field("prompt", f"made of token ids in [0, {vocab_size})", bad[0])
            prompts.append(list(p))
        else:
            raise bad_field("prompt", "a non-empty list of integer token ids", p)
    refuse_field(body, "suffix", "kvcore does not do fill-in-the-middle")
    stream = bool_field(body, "stream", False)
    echo = bool_field(body, "echo", False)
    logprobs = int_field(body, "logprobs", None, 0, MAX_LOGPROBS)
    if echo and logprobs is not None:
        raise InvalidRequestError("'echo' together with 'logprobs' is not supported (no prompt logprobs)")
    # OpenAI's legacy default for completions is 16 tokens.
    max_tokens = _max_tokens(int_field(body, "max_tokens", 16, 1), [len(p) for p in prompts], max_model_len)
    params = _params(body, max_tokens=max_tokens, logprobs=logprobs, vocab_size=vocab_size,
                     structured=structured_output(body))
    if len(prompts) * params.n > MAX_N:
        raise bad_field("n", f"at most {MAX_N} choices in all (prompts × n)", len(prompts) * params.n)
    return GenerationJob(
        model=body.get("model"),
        prompts=prompts,
        params=params,
        stream=stream,
        include_usage=stream_options_field(body, stream),
        echo=echo,
        prompt_texts=tuple(p if isinstance(p, str) else None for p in raw),
        want_logprobs=logprobs is not None,
        ignored_fields=ignored,
        structured_field=structured_field(body),
    )


def parse_chat(
    body: Mapping, tokenizer: Any, *, vocab_size: int, max_model_len: int, max_prompt_chars: int, strict: bool = False
) -> GenerationJob:
    """``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template (with ``tools``
    when given); messages that cannot fit ``max_model_len`` are refused from their length, before rendering
    and tokenising. ``strict``: an unknown field is a 400 instead of being ignored."""
    ignored = unknown_fields(body, CHAT_FIELDS, strict)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
        raise bad_field("messages", "a non-empty list of message objects", messages)
    refuse_field(body, "functions", "use 'tools'")
    refuse_field(body, "audio", "text only")
    tools = parse_tools(body, tokenizer)
    structured = structured_output(body)
    if tools is not None and structured is not None:
        raise with_param(InvalidRequestError("'tools' cannot be combined with a structured-output field"), "tools")
    texts = [message_text(m, i) for i, m in enumerate(messages)]
    _check_conversation(texts, max_prompt_chars)
    text = tokenizer.apply_chat_template(texts, add_generation_prompt=True, tools=list(tools.tools) if tools else None)
    prompt_ids = tokenizer.encode(text, add_bos=False)  # the template writes its own BOS
    stream = bool_field(body, "stream", False)
    want_logprobs = bool_field(body, "logprobs", False)
    top = int_field(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise bad_field("top_logprobs", "given only together with logprobs=true", top)
    requested = int_field(body, "max_completion_tokens", None, 1)
    if requested is None:
        requested = int_field(body, "max_tokens", None, 1)
    params = _params(
        body,
        max_tokens=_max_tokens(requested, [len(prompt_ids)], max_model_len),
        logprobs=(top or 0) if want_logprobs else None,
        vocab_size=vocab_size,
        structured=tools.constraint() if tools is not None else structured,
        unset=chat_defaults(tokenizer).unset_fields(body.get("temperature")),  # chat's, not OpenAI's
    )
    return GenerationJob(
        model=body.get("model"),
        prompts=[prompt_ids],
        params=params,
        stream=stream,
        include_usage=stream_options_field(body, stream),
        want_logprobs=want_logprobs,
        ignored_fields=ignored,
        tools=tools,
        structured_field=structured_field(body),
    )


def parse_tokenize(body: Mapping, tokenizer: Tokenizer, max_prompt_chars: int) -> list[int]:
    """``POST /tokenize`` (vLLM's): ``prompt`` (text; ``add_special_tokens`` adds the BOS the model wants) or
    chat ``messages`` (rendered with the chat template; ``add_generation_prompt``, default true). Text that
    cannot fit the model's context is refused from its length before any tokenizer work, as for completions."""
    if body.get("messages") is not None:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise bad_field("messages", "a list of message objects", messages)
        texts = [message_text(m, i) for i, m in enumerate(messages)]
        _check_conversation(texts, max_prompt_chars)
        generation_prompt = bool_field(body, "add_generation_prompt", True)
        text = tokenizer.apply_chat_template(texts, add_generation_prompt=generation_prompt)
        return tokenizer.encode(text, add_bos=False)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_field("prompt", "a string (or give 'messages')", prompt)
    _check_chars(len(prompt), max_prompt_chars, "the prompt")
    return tokenizer.encode(prompt, add_bos=None if bool_field(body, "add_special_tokens", True) else False)


def parse_detokenize(body: Mapping, vocab_size: int, max_model_len: int) -> list[int]:
    """``POST /detokenize`` (vLLM's): ``tokens``, a list of at most ``max_model_len`` token ids (no sequence of
    this model is longer), refused from its length before its ids are checked or decoded."""
    tokens = body.get("tokens")
    if isinstance(tokens, list) and len(tokens) > max_model_len:
        raise ContextLengthError(
            f"'tokens' has {len(tokens)} token ids; no sequence of this model is longer than its maximum context "
            f"length of {max_model_len} tokens; send fewer"
        )
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_field("tokens", "a list of token ids", tokens)
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise bad_field("tokens", f"token ids in [0, {vocab_size})", bad[0])
    return tokens
