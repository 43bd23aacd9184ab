"""``kvcore serve``: build the engine the way ``kvcore generate`` does, then serve it with uvicorn."""

from __future__ import annotations

import socket
import sys
import threading
import time
from dataclasses import fields
from typing import Any

from starlette.types import ASGIApp

from kvcore.engine.core import Engine
from kvcore.errors import ConfigError

__all__ = ["build_engine", "run_server", "banner", "ServerThread", "uvicorn_config", "DEFAULT_MAX_NUM_SEQS"]

#: requests a server runs at once unless --max-num-seqs or the config file says otherwise
DEFAULT_MAX_NUM_SEQS = 16
#: seconds a connection may take to send a request's headers (from connecting, or from the end of the
#: previous response); a client too slow is disconnected, so idle sockets cannot use up the descriptors
HEADER_TIMEOUT_S = 10.0
#: seconds an idle keep-alive connection stays open between requests
KEEP_ALIVE_TIMEOUT_S = 5


def _timed_h11_protocol(header_timeout_s: float) -> type:
    """uvicorn's h11 protocol with a deadline for each request's headers (uvicorn has none of its own)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        _header_deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._header_deadline = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def handle_events(self) -> None:
            super().handle_events()
            if not self._waiting_for_headers():
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self._waiting_for_headers():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _headers_too_slow(self) -> None:
            self._header_deadline = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                self.transport.close()

    return TimedH11Protocol


def uvicorn_config(app: ASGIApp, *, header_timeout_s: float = HEADER_TIMEOUT_S, **options: Any):
    """The uvicorn settings every kvcore server runs with: h11 with a header deadline, a short keep-alive."""
    import uvicorn

    return uvicorn.Config(app, http=_timed_h11_protocol(header_timeout_s), lifespan="on",
                          timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S, **options)


def build_engine(settings: dict[str, Any]):
    """An :class:`~kvcore.engine.core.Engine` from ``resolve_settings`` output (model, backends, cache, sampler,
    dtype, limits, plugin options), validating backend names before the slower model load."""
    from kvcore.engine.core import Engine, EngineConfig
    from kvcore.plugins.registry import get_registry

    registry = get_registry()
    if settings["plugin_options"]:
        registry.configure(settings["plugin_options"])
    given = {f.name: settings[f.name] for f in fields(EngineConfig) if settings.get(f.name) is not None}
    config = EngineConfig(**given)
    for name in {settings["backend"], settings["prefill_backend"], settings["decode_backend"]} - {None}:
        registry.create(name, settings["backend_options"].get(name))
    return Engine.from_pretrained(settings["model"], config, registry=registry, model_cache=settings.get("model_cache"))


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot resolve --host {host!r}: {exc}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)  # connections made before uvicorn accepts wait in the backlog
    return sock


def run_server(
    engine: Engine,
    *,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_queue_len: int = 256,
    log_level: str = "info",
    step_watchdog_s: float | None = None,
    strict: bool = False,
) -> int:
    """Serve until interrupted (Ctrl-C / SIGTERM): in-flight streams get a few seconds to finish, then the
    engine loop stops. Prints ``kvcore: serving <model> on http://<host>:<port>`` once bound (the real
    port when ``port`` is 0) and a line with the serving configuration. ``strict``: a request with an
    unknown field is a 400. Returns the exit code."""
    import uvicorn

    from kvcore.serving.async_engine import AsyncEngine
    from kvcore.serving.openai_api import build_app

    sock = _bind(host, port)
    bound_port = sock.getsockname()[1]
    watchdog = {} if step_watchdog_s is None else {"step_watchdog_s": step_watchdog_s or None}  # 0: off
    front = AsyncEngine(engine, max_queue_len=max_queue_len, **watchdog)
    app = build_app(front, model_name=model_name, api_key=api_key, strict=strict)
    config = uvicorn_config(app, log_level=log_level, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    shown = f"[{host}]" if ":" in host else host
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        print(f"kvcore: warning: serving on {host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    print(f"kvcore: serving {model_name} on http://{shown}:{bound_port} (OpenAI API under /v1)",
          file=sys.stderr, flush=True)
    print(f"kvcore: {banner(engine.serving_config())}", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        front.close()
        sock.close()
    return 0 if server.started else 1


def banner(serving: dict[str, Any]) -> str:
    """The serving configuration in one line: ``backend paged (prefill) / paged (decode), kv_cache ..., ...``, and
    ``speculative ngram (4 drafts per step)`` when a proposer is on, ``attention variants alibi`` when selected."""
    backends = serving["prefill_backend"]
    if serving["decode_backend"] != backends:
        backends = f"{backends} (prefill) / {serving['decode_backend']} (decode)"
    rest = ", ".join(f"{k} {serving[k]}" for k in ("kv_cache", "sampler", "dtype", "weights", "device",
                                                    "max_num_seqs", "max_model_len"))
    proposer = serving.get("proposer")
    speculative = f", speculative {proposer} ({serving['num_speculative_tokens']} drafts per step)" if proposer else ""
    variants = ", ".join(serving.get("attention_variants") or ())
    return f"backend {backends}, {rest}{speculative}" + (f", attention variants {variants}" if variants else "")


class ServerThread:
    """Serve an ASGI ``app`` with uvicorn in a background thread (tests, notebooks, embedding)::

        with ServerThread(app) as server:   # port 0: any free port on 127.0.0.1
            requests.get(server.url + "/health")

    Leaving the block stops the server (and runs the app's shutdown, which stops its engine loop).
    """

    def __init__(
        self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 30.0,
        header_timeout_s: float = HEADER_TIMEOUT_S,
    ) -> None:
        import uvicorn

        self._sock = _bind(host, port)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.startup_timeout_s = startup_timeout_s
        config = uvicorn_config(app, header_timeout_s=header_timeout_s, log_level="warning",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True,
                                        name="kvcore-http")

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def close(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._sock.close()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
