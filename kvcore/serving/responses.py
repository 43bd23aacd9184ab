"""kvcore token events → OpenAI response objects and SSE chunks (``text_completion`` and ``chat.completion``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvcore.scheduling.request import TokenEvent
from kvcore.serving.protocol import GenerationJob, usage
from kvcore.serving.tools import split_tool_calls
from kvcore.text.tokenizer import Tokenizer

__all__ = ["Choice", "CompletionFormat", "ChatFormat", "TokenTexts", "finish_reason"]

#: kvcore's finish reasons in OpenAI's vocabulary ("stop": a natural or requested stop; "length": a limit)
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "abort": "abort", "error": "error"}


def finish_reason(event: TokenEvent) -> str | None:
    return None if event.finish_reason is None else _FINISH[str(event.finish_reason)]


class TokenTexts:
    """The text of single token ids (what logprobs report), decoded once per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


@dataclass
class Choice:
    """What one choice (sample ``index``) produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, event: TokenEvent) -> None:
        self.text.append(event.text)
        if event.token_id is not None:
            self.token_ids.append(event.token_id)
            if event.logprob is not None:
                self.logprobs.append(event.logprob)
                self.top_logprobs.append(list(event.top_logprobs or ()))
        if event.finish_reason is not None:
            self.finish_reason = finish_reason(event)


class _Format:
    object_name: str
    chunk_object: str

    def __init__(self, job: GenerationJob, request_id: str, model: str, token_text: TokenTexts) -> None:
        self.job, self.request_id, self.model, self.token_text = job, request_id, model, token_text
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def response(self, choices: list[Choice], num_cached_tokens: int = 0) -> dict[str, Any]:
        out = self._envelope(self.object_name, [self._choice(c) for c in choices])
        out["usage"] = self.usage(choices, num_cached_tokens)
        return out

    def usage(self, choices: list[Choice], num_cached_tokens: int = 0) -> dict[str, int]:
        prompt = sum(len(p) for p in self.job.prompts)
        return usage(prompt, sum(len(c.token_ids) for c in choices), num_cached_tokens)

    def usage_chunk(self, choices: list[Choice], num_cached_tokens: int = 0) -> dict[str, Any]:
        out = self._envelope(self.chunk_object, [])
        out["usage"] = self.usage(choices, num_cached_tokens)
        return out

    def first_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return []

    def _is_empty(self, event: TokenEvent) -> bool:
        """Nothing to send: no text, not the end, and no logprob the client asked for."""
        wants_logprob = self.job.want_logprobs and event.logprob is not None
        return not event.text and event.finish_reason is None and not wants_logprob

    def _choice(self, c: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, index: int, event: TokenEvent) -> dict[str, Any] | None:
        raise NotImplementedError


class CompletionFormat(_Format):
    """``POST /v1/completions``: ``text_completion`` objects; logprobs in the legacy four-list form."""

    object_name = chunk_object = "text_completion"

    def __init__(self, *args: Any, prompt_texts: list[str] | None = None) -> None:
        super().__init__(*args)
        self.prompt_texts = prompt_texts or []

    def _logprobs(self, texts: list[str], token_ids: list[int], logprobs: list[float], tops: list, offset: int):
        offsets = []
        for t in texts:
            offsets.append(offset)
            offset += len(t)
        top = []
        for tid, lp, alts in zip(token_ids, logprobs, tops):
            entry: dict[str, float] = {}
            for i, v in [(tid, lp), *alts]:  # the chosen token is always listed (vLLM)
                # keyed by text: tokens that decode alike (incomplete UTF-8 bytes) share a key; keep the likeliest
                text = self.token_text(i)
                entry[text] = max(v, entry.get(text, v))
            top.append(entry)
        return {
            "tokens": [self.token_text(i) for i in token_ids],
            "token_logprobs": list(logprobs),
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _choice(self, c: Choice) -> dict[str, Any]:
        prefix = self.prompt_texts[c.index // self.job.params.n] if self.job.echo else ""
        logprobs = None
        if self.job.want_logprobs:
            texts = [t for t, _ in zip(c.text, c.token_ids)]
            logprobs = self._logprobs(texts, c.token_ids, c.logprobs, c.top_logprobs, len(prefix))
        return {"index": c.index, "text": prefix + "".join(c.text), "logprobs": logprobs,
                "finish_reason": c.finish_reason}

    def first_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        if not self.job.echo:
            return []
        n = self.job.params.n
        return [self._envelope(self.chunk_object, [{"index": i, "text": self.prompt_texts[i // n], "logprobs": None,
                                                     "finish_reason": None}]) for i in range(num_choices)]

    def chunk(self, index: int, event: TokenEvent) -> dict[str, Any] | None:
        if self._is_empty(event):
            return None  # a token that completed no character yet (half of a UTF-8 sequence)
        logprobs = None
        if self.job.want_logprobs and event.token_id is not None and event.logprob is not None:
            logprobs = self._logprobs([event.text], [event.token_id], [event.logprob], [event.top_logprobs or []], 0)
        choice = {"index": index, "text": event.text, "logprobs": logprobs, "finish_reason": finish_reason(event)}
        return self._envelope(self.chunk_object, [choice])


class ChatFormat(_Format):
    """``POST /v1/chat/completions``: an assistant message; logprobs as ``{"content": [...]}``."""

    object_name, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._held: dict[int, list[str]] = {}  # with tools: each choice's text until it ends

    def _entry(self, token_id: int, logprob: float, alts: list[tuple[int, float]]) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {
            "token": text,
            "logprob": logprob,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": self.token_text(i), "logprob": v, "bytes": list(self.token_text(i).encode("utf-8"))}
                for i, v in alts
            ],
        }

    def _logprobs(self, c: Choice) -> dict[str, Any] | None:
        if not self.job.want_logprobs:
            return None
        content = [self._entry(t, lp, alts) for t, lp, alts in zip(c.token_ids, c.logprobs, c.top_logprobs)]
        return {"content": content, "refusal": None}

    def _choice(self, c: Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(c.text), "refusal": None}
        finish = c.finish_reason
        if self.job.tools is not None:
            message["content"], calls = split_tool_calls(message["content"])
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": c.index, "message": message, "logprobs": self._logprobs(c), "finish_reason": finish}

    def _tool_chunk(self, index: int, event: TokenEvent) -> dict[str, Any] | None:
        """With tools, a choice's text is held back until it ends, then sent as content or as tool calls."""
        buffer = self._held.setdefault(index, [])
        buffer.append(event.text)
        if event.finish_reason is None:
            return None
        content, calls = split_tool_calls("".join(buffer))
        finish = finish_reason(event)
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            finish = "tool_calls" if finish == "stop" else finish
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return self._envelope(self.chunk_object, [choice])

    def first_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        # OpenAI opens every choice's stream with the role.
        return [
            self._envelope(self.chunk_object, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}])
            for i in range(num_choices)
        ]

    def chunk(self, index: int, event: TokenEvent) -> dict[str, Any] | None:
        if self.job.tools is not None:
            return self._tool_chunk(index, event)
        if self._is_empty(event):
            return None
        logprobs = None
        if self.job.want_logprobs and event.token_id is not None and event.logprob is not None:
            entry = self._entry(event.token_id, event.logprob, list(event.top_logprobs or ()))
            logprobs = {"content": [entry], "refusal": None}
        delta = {"content": event.text} if event.text else {}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason(event)}
        return self._envelope(self.chunk_object, [choice])
