"""HTTP plumbing of the OpenAI server: an error as OpenAI's body with its status, server-sent events that stop
the moment the client goes away, and the merge of several prompts' streams into one choice order."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from kvcore.errors import (
    ChatTemplateError,
    ContextLengthError,
    InvalidRequestError,
    KVCoreError,
    ModelFileChangedError,
    OutOfBlocksError,
)
from kvcore.serving.protocol import error_body
from kvcore.serving.stream import EngineDeadError, EngineStepError, QueueFullError, RequestStream

__all__ = [
    "HTTPError", "error_response", "SSEResponse", "merge_streams", "sse_event", "until_disconnect", "decode_json_body",
    "RETRY_AFTER_S", "MAX_JSON_CONTAINERS",
]

logger = logging.getLogger("kvcore.serving.openai_api")

#: what a 429 tells the client to wait before retrying, in seconds
RETRY_AFTER_S = 1
#: most '{' and '[' bytes a body may hold (inside strings too): each JSON object or array costs tens of bytes
#: of memory once parsed, so this bounds what a body of tiny containers can cost
MAX_JSON_CONTAINERS = 1_000_000


class HTTPError(Exception):
    def __init__(self, status: int, message: str, err_type: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.err_type, self.code = status, err_type, code


def error_response(exc: BaseException) -> JSONResponse:
    """The HTTP answer for an exception: its status, and OpenAI's error body."""
    headers = None
    param = getattr(exc, "param", None)
    if isinstance(exc, HTTPError):
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
    elif isinstance(exc, (EngineDeadError, ModelFileChangedError)):
        status, err_type, code = 503, "server_error", "engine_unavailable"
    elif isinstance(exc, EngineStepError):
        status, err_type, code = 500, "server_error", "engine_error"
    elif isinstance(exc, KVCoreError):
        status, err_type, code = 500, "server_error", type(exc).__name__
    else:
        logger.exception("internal error while serving a request", exc_info=exc)
        status, err_type, code = 500, "server_error", "internal_error"
    message = str(exc) if isinstance(exc, KVCoreError | HTTPError) else f"internal error: {type(exc).__name__}"
    # a message may echo the request's text, lone surrogates included, which UTF-8 cannot carry
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return JSONResponse(error_body(message, err_type, code, param), status_code=status, headers=headers)


class SSEResponse(StreamingResponse):
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


async def merge_streams(streams: list[RequestStream], n: int) -> AsyncIterator[tuple[int, Any]]:
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


def sse_event(obj: dict[str, Any]) -> str:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def decode_json_body(data: bytes) -> dict:
    """A request body as a JSON object, refused (400) before parsing when it holds too many containers."""
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
