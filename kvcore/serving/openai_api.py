"""The OpenAI-compatible HTTP API behind ``kvcore serve``: a Starlette ASGI app over an :class:`AsyncEngine`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or SSE chunks ending with
``data: [DONE]`` when ``stream`` is true), ``GET /v1/models`` (with the serving configuration), ``POST /tokenize``
and ``POST /detokenize`` (vLLM's), ``GET /health``, ``GET /metrics``. Unknown request fields are logged and named
in the ``kvcore-ignored-fields`` response header (a 400 with ``strict``); an unknown route is a 404 error body.
Errors are OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` with the status of their
kind (400 invalid request or context too long, 401 bad API key, 404 unknown model, 429 queue full with
``Retry-After``, 500/503 server side). A client that disconnects aborts its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from kvcore.errors import ContextLengthError, GrammarError, KVCoreError
from kvcore.serving.async_engine import AsyncEngine
from kvcore.serving.fields import field_names
from kvcore.serving.http import (
    HTTPError,
    SSEResponse,
    decode_json_body,
    error_response,
    merge_streams,
    sse_event,
    until_disconnect,
)
from kvcore.serving.metrics import CONTENT_TYPE
from kvcore.serving.protocol import (
    GenerationJob,
    error_body,
    max_body_bytes,
    max_prompt_chars,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from kvcore.serving.responses import ChatFormat, Choice, CompletionFormat, TokenTexts
from kvcore.serving.stream import EngineDeadError, RequestStream

__all__ = ["build_app"]

logger = logging.getLogger(__name__)

#: largest request body read (bytes): far below what would hurt the server; a bigger body is answered 413
#: without being read to the end. A body past what the model's context can use (protocol.max_body_bytes)
#: is read but refused unparsed (400 context_length_exceeded)
MAX_REQUEST_BYTES = 16 * 1024 * 1024
#: seconds a client may take to send its whole request body once the headers are in (408 after that)
BODY_TIMEOUT_S = 30.0
#: requests parsed and tokenised at once, in worker threads; others wait their turn without blocking
#: the event loop (a parse holds at most one body's worth of JSON in memory)
MAX_CONCURRENT_PARSES = 4


def build_app(
    front: AsyncEngine, *, model_name: str, api_key: str | None = None, close_front: bool = True, strict: bool = False
) -> Starlette:
    """The ASGI app serving ``front``'s engine as ``model_name``.

    :param api_key: when set, ``/v1/*``, ``/tokenize`` and ``/detokenize`` require ``Authorization: Bearer
        <api_key>`` (401 otherwise); ``/health`` and ``/metrics`` stay open.
    :param close_front: stop the engine loop when the app shuts down (its lifespan ends).
    :param strict: answer a request with an unknown field 400 instead of ignoring the field.
    """
    engine = front.engine
    tokenizer = engine.tokenizer
    vocab_size = engine.model.config.vocab_size
    prompt_chars = max_prompt_chars(tokenizer, engine.max_model_len) if tokenizer is not None else 0
    limits = dict(vocab_size=vocab_size, max_model_len=engine.max_model_len, max_prompt_chars=prompt_chars)
    body_limit = min(MAX_REQUEST_BYTES, max_body_bytes(prompt_chars, vocab_size))
    parsing = asyncio.Semaphore(MAX_CONCURRENT_PARSES)
    metrics = front.metrics
    token_text = TokenTexts(tokenizer)

    def counted(endpoint: str, handler: Callable) -> Callable:
        async def wrapped(request: Request) -> Response:
            try:
                response = await handler(request)
            except ClientDisconnect:  # the client hung up before its request was in: nobody to answer
                response = Response(status_code=499)
            except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
                response = error_response(exc)
            metrics.http_requests.labels(endpoint=endpoint, status=str(response.status_code)).inc()
            return response

        return wrapped

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise HTTPError(401, "invalid API key: send 'Authorization: Bearer <key>'", "invalid_request_error",
                             "invalid_api_key")

    async def read_body(request: Request) -> bytes:
        """The body's bytes, bounded in size and in time; a body this model cannot use is not parsed."""
        too_large = HTTPError(413, f"the request body exceeds {MAX_REQUEST_BYTES} bytes", "invalid_request_error",
                               "request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_REQUEST_BYTES:
            raise too_large
        chunks, size = [], 0
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > MAX_REQUEST_BYTES:
                        raise too_large
                    chunks.append(chunk)
        except TimeoutError:
            raise HTTPError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s",
                             "invalid_request_error", "request_timeout") from None
        if size > body_limit:
            raise ContextLengthError(
                f"the request body has {size} bytes; no request to this model's context of {engine.max_model_len} "
                f"tokens needs more than {body_limit}; shorten the prompt"
            )
        return b"".join(chunks)

    def prepare(data: bytes, parse: Callable, fmt_cls: type, request_id: str):
        """Body → job and response format: JSON decoding, templating and tokenising (a worker thread)."""
        job: GenerationJob = parse(decode_json_body(data), tokenizer, **limits, strict=strict)
        if job.model is not None and job.model != model_name:
            raise HTTPError(404, f"the model '{job.model}' does not exist; this server serves '{model_name}'",
                             "invalid_request_error", "model_not_found")
        extra = {}
        if fmt_cls is CompletionFormat:
            extra["prompt_texts"] = [text if text is not None else tokenizer.decode(ids, skip_special_tokens=False)
                                     for text, ids in zip(job.prompt_texts, job.prompts)]
        return job, fmt_cls(job, request_id, model_name, token_text, **extra)

    async def generate(request: Request, parse: Callable, fmt_cls: type, prefix: str) -> Response:
        check_auth(request)
        if tokenizer is None:
            raise EngineDeadError("this server's model has no tokenizer")
        data = await read_body(request)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        async with parsing:  # the event loop only waits: the work runs in a thread, a bounded number at once
            job, fmt = await asyncio.to_thread(prepare, data, parse, fmt_cls, request_id)
        headers = {}
        if job.ignored_fields:  # names the client chose: escaped, so they cannot forge a log line or break the header
            names = field_names(job.ignored_fields)
            logger.warning("the request's fields %s are not known and were ignored", names)
            headers["kvcore-ignored-fields"] = names
        streams: list[RequestStream] = []
        try:
            for p, prompt in enumerate(job.prompts):
                streams.append(await front.submit(prompt, job.params, f"{request_id}-{p}"))
        except GrammarError as exc:  # compiled by the engine: name the field it came from
            for s in streams:
                s.abort()
            error = GrammarError(f"'{job.structured_field}': {exc}")
            error.param = job.structured_field  # type: ignore[attr-defined]
            raise error from None
        except BaseException:
            for s in streams:
                s.abort()
            raise
        if job.stream:
            response = SSEResponse(_sse(job, fmt, streams))
            response.headers.update(headers)
            return response
        work = asyncio.ensure_future(_collect(job, fmt, streams))
        watch = asyncio.ensure_future(until_disconnect(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            gone = not work.done()
            if gone:  # the client went away: stop generating for it
                work.cancel()
                for s in streams:
                    s.abort()
        if gone:
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        return JSONResponse(work.result(), headers=headers)

    async def _collect(job: GenerationJob, fmt, streams: list[RequestStream]) -> dict:
        choices = [Choice(i) for i in range(len(job.prompts) * job.params.n)]
        async for index, event in merge_streams(streams, job.params.n):
            if event.error is not None:
                raise event.error
            choices[index].add(event)
        return fmt.response(choices, sum(s.num_cached_tokens for s in streams))

    async def _sse(job: GenerationJob, fmt, streams: list[RequestStream]) -> AsyncIterator[str]:
        choices = [Choice(i) for i in range(len(job.prompts) * job.params.n)]
        try:
            for chunk in fmt.first_chunks(len(choices)):
                yield sse_event(chunk)
            async for index, event in merge_streams(streams, job.params.n):
                if event.error is not None:
                    body = json.loads(error_response(event.error).body)
                    yield sse_event(body)
                    break
                choices[index].add(event)
                chunk = fmt.chunk(index, event)
                if chunk is not None:
                    yield sse_event(chunk)
            if job.include_usage:
                yield sse_event(fmt.usage_chunk(choices, sum(s.num_cached_tokens for s in streams)))
        except KVCoreError as exc:  # the engine stopped mid-stream: tell the client in the stream
            yield sse_event(json.loads(error_response(exc).body))
        finally:
            for s in streams:
                s.abort()
        yield "data: [DONE]\n\n"

    async def completions(request: Request) -> Response:
        return await generate(request, parse_completion, CompletionFormat, "cmpl")

    async def chat_completions(request: Request) -> Response:
        return await generate(request, parse_chat, ChatFormat, "chatcmpl")

    card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "kvcore",
            "max_model_len": limits["max_model_len"], "serving": engine.serving_config()}

    async def tokenize(request: Request) -> Response:
        check_auth(request)
        if tokenizer is None:
            raise EngineDeadError("this server's model has no tokenizer")
        data = await read_body(request)
        async with parsing:  # tokenising is unbounded work: off the event loop, as for generation
            ids = await asyncio.to_thread(lambda: parse_tokenize(decode_json_body(data), tokenizer, prompt_chars))
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": limits["max_model_len"]})

    async def detokenize(request: Request) -> Response:
        check_auth(request)
        if tokenizer is None:
            raise EngineDeadError("this server's model has no tokenizer")
        data = await read_body(request)

        def detokenized() -> str:  # JSON decoding and detokenising: off the event loop
            ids = parse_detokenize(decode_json_body(data), limits["vocab_size"], limits["max_model_len"])
            return tokenizer.decode(ids, skip_special_tokens=False)

        async with parsing:
            text = await asyncio.to_thread(detokenized)
        return JSONResponse({"prompt": text})

    async def models(request: Request) -> Response:
        check_auth(request)
        name = request.path_params.get("model")
        if name is None:
            return JSONResponse({"object": "list", "data": [card]})
        if name != model_name:
            raise HTTPError(404, f"the model '{name}' does not exist", "invalid_request_error", "model_not_found")
        return JSONResponse(card)

    async def health(request: Request) -> Response:
        problem = front.health()
        if problem is not None:
            raise EngineDeadError(problem)
        return JSONResponse({"status": "ok"})

    async def prometheus(request: Request) -> Response:
        return PlainTextResponse(metrics.render(front.stats), media_type=CONTENT_TYPE)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        if close_front:
            await asyncio.to_thread(front.close)

    routes = [
        Route("/v1/completions", counted("/v1/completions", completions), methods=["POST"]),
        Route("/v1/chat/completions", counted("/v1/chat/completions", chat_completions), methods=["POST"]),
        Route("/v1/models", counted("/v1/models", models), methods=["GET"]),
        Route("/v1/models/{model:path}", counted("/v1/models", models), methods=["GET"]),
        Route("/tokenize", counted("/tokenize", tokenize), methods=["POST"]),
        Route("/detokenize", counted("/detokenize", detokenize), methods=["POST"]),
        Route("/health", counted("/health", health), methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]

    async def http_error(request: Request, exc: HTTPException) -> Response:
        # Starlette's own answers (unknown route, wrong method) in OpenAI's error shape too
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, "invalid_request_error", code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
