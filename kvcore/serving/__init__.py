"""Serving: a thread-safe front over one :class:`~kvcore.engine.core.Engine` and an OpenAI-compatible HTTP API.

- :class:`AsyncEngine` (``async_engine.py``): one engine-loop thread owns the engine; requests come in
  through a queue, each gets an async stream of token events out.
- :func:`build_app` (``openai_api.py``): the Starlette ASGI app behind ``kvcore serve``
  (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``).
"""

from kvcore.serving.async_engine import AsyncEngine
from kvcore.serving.metrics import ServingMetrics
from kvcore.serving.stream import EngineDeadError, EngineStepError, QueueFullError, RequestStream

__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "EngineStepError",
    "QueueFullError",
    "RequestStream",
    "ServingMetrics",
    "build_app",
]


def __getattr__(name: str):
    # The HTTP app imports Starlette; the engine front does not need it.
    if name == "build_app":
        from kvcore.serving.openai_api import build_app

        return build_app
    raise AttributeError(name)
