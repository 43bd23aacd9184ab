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
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvcore.errors import (
    ChatTemplateError,
    ContextLengthError,
    GrammarError,
    InvalidRequestError,
    KVCoreError,
    OutOfBlocksError,
)
from kvcore.serving.async_engine import AsyncEngine
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
from kvcore.serving.stream import EngineDeadError, EngineStepError, QueueFullError, RequestStream

__all__ = ["build_app", "RETRY_AFTER_S"]

logger = logging.getLogger(__name__)

#: what a 429 tells the client to wait before retrying, in seconds
RETRY_AFTER_S = 1
#: largest request body read (bytes): far below what would hurt the server; a bigger body is answered 413
#: without being read to the end. A body past what the model's context can use (protocol.max_body_bytes)
#: is read but refused unparsed (400 context_length_exceeded)
MAX_REQUEST_BYTES = 16 * 1024 * 1024
#: seconds a client may take to send its whole request body once the headers are in (408 after that)
BODY_TIMEOUT_S = 30.0
#: most '{' and '[' bytes a body may hold (inside strings too): each JSON object or array costs tens of bytes
#: of memory once parsed, so this bounds what a body of tiny containers can cost
MAX_JSON_CONTAINERS = 1_000_000
#: requests parsed and tokenised at once, in worker threads; others wait their turn without blocking
#: the event loop (a parse holds at most one body's worth of JSON in memory)
MAX_CONCURRENT_PARSES = 4


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, err_type: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.err_type, self.code = status, err_type, code


def _error_response(exc: BaseException) -> JSONResponse:
    """The HTTP answer for an exception: its status, and OpenAI's error body."""
    headers = None
    param = getattr(exc, "param", None)
    if isinstance(exc, _HTTPError):
        status, err_type, code = exc.status, exc.err_type, exc.code
    elif isinstance(exc, ContextLengthError):
        status, err_type, code = 400, "invalid_request_error", "context_length_exceeded"
    elif isinstance(exc, (InvalidRequestError, OutOfBlocksError)):
        status, err_type, code = 400, "invalid_request_error", None
    elif isinstance(exc, ChatTemplateError):  # the client's messages drove the render past a limit (as vLLM: 400)
        status, err_type, code = 400, "invalid_request_error", "chat_template_error"
    elif isinstance(exc, QueueFullError):
        status, err_type, code = 429, "rate_limit_error", "queue_full"
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    elif isinstance(exc, EngineDeadError):
        status, err_type, code = 503, "server_error", "engine_unavailable"
    elif isinstance(exc, EngineStepError):
        status, err_type, code = 500, "server_error", "engine_error"
    elif isinstance(exc, KVCoreError):
        status, err_type, code = 500, "server_error", type(exc).__name__
    else:
        logger.exception("internal error while serving a request", exc_info=exc)
        status, err_type, code = 500, "server_error", "internal_error"
    message = str(exc) if isinstance(exc, KVCoreError | _HTTPError) else f"internal error: {type(exc).__name__}"
    return JSONResponse(error_body(message, err_type, code, param), status_code=status, headers=headers)


class _SSEResponse(StreamingResponse):
    """Server-sent events that stop at once when the client goes away, whatever the ASGI version: a
    disconnect cancels the stream, and the body iterator is always closed (its ``finally`` aborts)."""

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        streaming = asyncio.ensure_future(self._send_all(send))
        listening = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, listening}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, listening):
                task.cancel()
            await asyncio.gather(streaming, listening, return_exceptions=True)
            await self.body_iterator.aclose()

    async def _send_all(self, send) -> None:
        with contextlib.suppress(OSError):  # the client went away while we were writing
            await self.stream_response(send)


async def _merge(streams: list[RequestStream], n: int) -> AsyncIterator[tuple[int, Any]]:
    """``(choice index, event)`` from every prompt's stream: choice ``p * n + i`` (OpenAI's order)."""
    if len(streams) == 1:
        async for i, event in streams[0]:
            yield i, event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def forward(p: int, stream: RequestStream) -> None:
        try:
            async for i, event in stream:
                await queue.put((p * n + i, event))
            await queue.put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put(exc)

    tasks = [asyncio.ensure_future(forward(p, s)) for p, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


def _event(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
                response = _error_response(exc)
            metrics.http_requests.labels(endpoint=endpoint, status=str(response.status_code)).inc()
            return response

        return wrapped

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise _HTTPError(401, "invalid API key: send 'Authorization: Bearer <key>'", "invalid_request_error",
                             "invalid_api_key")

    async def read_body(request: Request) -> bytes:
        """The body's bytes, bounded in size and in time; a body this model cannot use is not parsed."""
        too_large = _HTTPError(413, f"the request body exceeds {MAX_REQUEST_BYTES} bytes", "invalid_request_error",
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
            raise _HTTPError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s",
                             "invalid_request_error", "request_timeout") from None
        if size > body_limit:
            raise ContextLengthError(
                f"the request body has {size} bytes; no request to this model's context of {engine.max_model_len} "
                f"tokens needs more than {body_limit}; shorten the prompt"
            )
        return b"".join(chunks)

    def decode_body(data: bytes) -> dict:
        if data.count(b"{") + data.count(b"[") > MAX_JSON_CONTAINERS:
            raise InvalidRequestError(f"the request body has more than {MAX_JSON_CONTAINERS} '{{' and '[' characters; "
                                      "no request needs that many (write them inside strings as \\u007b, \\u005b)")
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise InvalidRequestError("the request body is nested too deeply to be a request") from None
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        return body

    def prepare(data: bytes, parse: Callable, fmt_cls: type, request_id: str):
        """Body → job and response format: JSON decoding, templating and tokenising (a worker thread)."""
        job: GenerationJob = parse(decode_body(data), tokenizer, **limits, strict=strict)
        if job.model is not None and job.model != model_name:
            raise _HTTPError(404, f"the model '{job.model}' does not exist; this server serves '{model_name}'",
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
        if job.ignored_fields:
            logger.warning("the request's fields %s are not known and were ignored", ", ".join(job.ignored_fields))
            headers["kvcore-ignored-fields"] = ", ".join(job.ignored_fields)
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
            response = _SSEResponse(_sse(job, fmt, streams))
            response.headers.update(headers)
            return response
        work = asyncio.ensure_future(_collect(job, fmt, streams))
        watch = asyncio.ensure_future(_until_disconnect(request))
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
        async for index, event in _merge(streams, job.params.n):
            if event.error is not None:
                raise event.error
            choices[index].add(event)
        return fmt.response(choices, sum(s.num_cached_tokens for s in streams))

    async def _sse(job: GenerationJob, fmt, streams: list[RequestStream]) -> AsyncIterator[str]:
        choices = [Choice(i) for i in range(len(job.prompts) * job.params.n)]
        try:
            for chunk in fmt.first_chunks(len(choices)):
                yield _event(chunk)
            async for index, event in _merge(streams, job.params.n):
                if event.error is not None:
                    body = json.loads(_error_response(event.error).body)
                    yield _event(body)
                    break
                choices[index].add(event)
                chunk = fmt.chunk(index, event)
                if chunk is not None:
                    yield _event(chunk)
            if job.include_usage:
                yield _event(fmt.usage_chunk(choices, sum(s.num_cached_tokens for s in streams)))
        except KVCoreError as exc:  # the engine stopped mid-stream: tell the client in the stream
            yield _event(json.loads(_error_response(exc).body))
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
            ids = await asyncio.to_thread(lambda: parse_tokenize(decode_body(data), tokenizer))
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": limits["max_model_len"]})

    async def detokenize(request: Request) -> Response:
        check_auth(request)
        if tokenizer is None:
            raise EngineDeadError("this server's model has no tokenizer")
        data = await read_body(request)

        def detokenized() -> str:  # JSON decoding and detokenising: off the event loop
            ids = parse_detokenize(decode_body(data), limits["vocab_size"])
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
            raise _HTTPError(404, f"the model '{name}' does not exist", "invalid_request_error", "model_not_found")
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
