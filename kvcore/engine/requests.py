"""A request as the engine takes it in and hands it back: the prompt checked against the model and the
engine's limits, and the :class:`~kvcore.scheduling.request.GenerationResult` of a request's state."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

from kvcore.errors import ContextLengthError, InvalidRequestError
from kvcore.interfaces.sampler import SamplingParams
from kvcore.model.config import DEFAULT_MAX_MODEL_LEN
from kvcore.model.decoder import DecoderModel
from kvcore.sampling.structured import GrammarCompiler
from kvcore.scheduling.request import GenerationResult, Request, TokenEvent
from kvcore.text.outputs import StopStrings, TextOutput
from kvcore.text.tokenizer import Tokenizer

__all__ = ["new_requests", "prompt_batch", "prompt_token_ids", "request_result", "run_batch", "run_chat",
           "stream_events"]


def prompt_token_ids(
    prompt: str | Sequence[int], params: SamplingParams, tokenizer: Tokenizer | None, model: DecoderModel,
    max_num_seqs: int,
    max_model_len: int,
) -> list[int]:
    """``prompt``'s token ids, after checking what a request can be refused for before it runs: an empty
    prompt, ids outside the vocabulary (prompt or ``logit_bias``), stop strings without a tokenizer, more
    samples than run together, a prompt plus ``max_new_tokens`` past ``max_model_len``."""
    vocab_size = model.config.vocab_size
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer: pass prompt token ids")
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        prompt_ids = tokenizer.encode(prompt)
    else:
        prompt_ids = [int(t) for t in prompt]
    if not prompt_ids:
        raise InvalidRequestError("prompt is empty (no tokens)")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size] + [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        what = "prompt token id" if bad[0] in prompt_ids else "logit_bias token id"
        raise InvalidRequestError(f"{what} {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if params.stop and tokenizer is None:
        raise InvalidRequestError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
    if params.n > max_num_seqs:
        raise InvalidRequestError(
            f"n = {params.n} samples cannot run together: max_num_seqs is {max_num_seqs}")
    total = len(prompt_ids) + params.max_new_tokens
    if total > max_model_len:
        raise ContextLengthError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} exceeds "
            f"the context limit of {max_model_len} tokens; {_context_fix(max_model_len, model.context_window)}"
        )
    return prompt_ids


def _context_fix(max_model_len: int, window: int) -> str:
    """How to make a request fit: past kvcore's cap (which reads like the model's window) name the setting
    that raises it and how far (``window``: the model's own context window); at that window, say there is no
    more."""
    if max_model_len >= window:
        return f"shorten the prompt or lower max_new_tokens ({window} tokens is the model's whole context window)"
    cap = (f" ({DEFAULT_MAX_MODEL_LEN} is kvcore's default cap, not the model's)"
           if max_model_len == DEFAULT_MAX_MODEL_LEN else "")
    return (f"shorten the prompt, lower max_new_tokens or raise max_model_len (--max-model-len) up to the model's "
            f"context window of {window} tokens{cap}")


def new_requests(
    ids: list[str], prompt_ids: list[int], params: SamplingParams, eos_token_ids: frozenset[int],
    tokenizer: Tokenizer | None, grammars: GrammarCompiler | None,
) -> list[Request]:
    """The requests of one added prompt, one per sample id of ``ids`` (sample ``i`` seeded ``params.seed + i``, or
    from a seed drawn now), each with its text output and, for structured output, its grammar matcher."""
    seed = params.seed if params.seed is not None else time.time_ns() % 2**63
    if params.structured_output is not None and grammars is None:
        raise InvalidRequestError("structured output needs a tokenizer; this engine has none")
    reqs = [Request(rid, list(prompt_ids), params, eos_token_ids, seed=seed + i) for i, rid in enumerate(ids)]
    for req in reqs:
        if params.structured_output is not None:
            req.matcher = grammars.matcher(params.structured_output)
        req.metrics.num_prompt_tokens = len(prompt_ids)
        decoder = tokenizer.stream_decoder() if tokenizer is not None else None
        req.text_output = TextOutput(decoder, StopStrings(params.stop) if params.stop else None)
    return reqs


def request_result(req: Request, tokenizer: Tokenizer | None) -> GenerationResult:
    """The state of request ``req``; final once it finished."""
    if req.params.stop or tokenizer is None:
        text = req.text_output.text  # what was streamed: cut before a stop string
    else:
        text = tokenizer.decode(req.output_ids)
    with_logprobs = req.params.logprobs is not None
    decoded = top_decoded = None
    if with_logprobs and tokenizer is not None:
        def piece(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False)

        decoded = [piece(t) for t in req.output_ids]
        top_decoded = [[piece(t) for t, _ in alts] for alts in req.top_logprobs]
    return GenerationResult(
        request_id=req.request_id,
        prompt_token_ids=list(req.prompt_ids),
        token_ids=list(req.output_ids),
        text=text,
        finish_reason=req.finish_reason,
        metrics=req.metrics,
        error=req.error,
        logprobs=list(req.logprobs) if with_logprobs else None,
        top_logprobs=[list(t) for t in req.top_logprobs] if with_logprobs else None,
        decoded_tokens=decoded,
        top_decoded_tokens=top_decoded,
    )


def prompt_batch(
    prompts: str | Iterable[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None
) -> list[tuple[str | Sequence[int], SamplingParams | None]]:
    """``(prompt, params)`` pairs of a ``generate`` call: a single string is one prompt (as in vLLM), so is a
    flat list of token ids; one ``params`` for all, or one per prompt."""
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        prompts = [prompts]
    per = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(per) != len(prompts):
        raise InvalidRequestError(f"got {len(prompts)} prompts but {len(per)} sampling params")
    return list(zip(prompts, per))


class RequestAPI(Protocol):
    """What the conveniences below drive an engine through: its public request API only, as any caller's own
    loop would (:class:`~kvcore.engine.core.Engine`'s)."""

    tokenizer: Tokenizer | None

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str: ...

    def sample_ids(self, request_id: str) -> list[str]: ...

    def is_finished(self, request_id: str) -> bool: ...

    def step(self) -> list[TokenEvent]: ...

    def abort(self, request_id: str) -> None: ...

    def release(self, request_id: str) -> GenerationResult: ...


def run_batch(
    engine: RequestAPI, batch: list[tuple[str | Sequence[int], SamplingParams | None]]
) -> list[GenerationResult]:
    """Run ``batch`` to completion; results in order (with ``n > 1``, a prompt's samples in sample order).
    Interrupted, it aborts and forgets its requests, leaving the engine as it found it."""
    ids: list[str] = []
    try:
        for i, (prompt, p) in enumerate(batch):
            try:
                ids += engine.sample_ids(engine.add_request(prompt, p))
            except InvalidRequestError as exc:
                if len(batch) == 1:
                    raise
                raise type(exc)(f"prompts[{i}] (of {len(batch)}): {exc}") from None  # which one of a long list
        while not all(engine.is_finished(r) for r in ids):
            engine.step()
    except BaseException:
        _drop(engine, ids)
        raise
    return [engine.release(r) for r in ids]


def run_chat(engine: RequestAPI, messages: list[dict], params: SamplingParams | None, tools: list[dict] | None
             ) -> GenerationResult:
    """One conversation rendered with the model's chat template, generated to completion (the first sample)."""
    if engine.tokenizer is None:
        raise InvalidRequestError("this engine has no tokenizer: chat needs one for the chat template")
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    return run_batch(engine, [(engine.tokenizer.encode(text, add_bos=False), params)])[0]


def stream_events(
    engine: RequestAPI, prompt: str | Sequence[int], params: SamplingParams | None
) -> Iterator[TokenEvent]:
    """The events of one request's tokens (of each sample, n > 1); released when the stream ends or closes."""
    ids = engine.sample_ids(engine.add_request(prompt, params))
    try:
        while not all(engine.is_finished(r) for r in ids):
            for event in engine.step():
                if event.request_id in ids:
                    yield event
    finally:
        _drop(engine, ids)


def _drop(engine: RequestAPI, ids: list[str]) -> None:
    for rid in ids:
        try:
            engine.abort(rid)
            engine.release(rid)
        except KeyError:  # already released
            continue
