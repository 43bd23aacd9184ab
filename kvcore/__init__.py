"""kvcore: swap attention implementations and KV caches under one generation driver."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# The public names load on first use (PEP 562): `import kvcore.cli` or `kvcore.errors` stays light (no
# torch), so the CLI can answer --help at once and handle a Ctrl-C while torch loads.
_EXPORTS = {
    "AttentionBackend": "kvcore.attention",
    "AttentionMetadata": "kvcore.attention",
    "BackendCapabilities": "kvcore.attention",
    "causal_mask": "kvcore.attention",
    "Engine": "kvcore.engine",
    "EngineConfig": "kvcore.engine",
    "KVCoreError": "kvcore.errors",
    "hookimpl": "kvcore.hookspecs",
    "CacheCapabilities": "kvcore.kv_cache",
    "CacheSpec": "kvcore.kv_cache",
    "KVCache": "kvcore.kv_cache",
    "LlamaModel": "kvcore.model",
    "ModelConfig": "kvcore.model_config",
    "FinishReason": "kvcore.request",
    "GenerationResult": "kvcore.request",
    "TokenEvent": "kvcore.request",
    "DefaultSampler": "kvcore.sampling",
    "Sampler": "kvcore.sampling",
    "SamplingParams": "kvcore.sampling",
    "SamplingRow": "kvcore.sampling",
    "StructuredOutput": "kvcore.structured",
}

if TYPE_CHECKING:
    from kvcore.attention import AttentionBackend, AttentionMetadata, BackendCapabilities, causal_mask
    from kvcore.engine import Engine, EngineConfig
    from kvcore.errors import KVCoreError
    from kvcore.hookspecs import hookimpl
    from kvcore.kv_cache import CacheCapabilities, CacheSpec, KVCache
    from kvcore.model import LlamaModel
    from kvcore.model_config import ModelConfig
    from kvcore.request import FinishReason, GenerationResult, TokenEvent
    from kvcore.sampling import DefaultSampler, Sampler, SamplingParams, SamplingRow
    from kvcore.structured import StructuredOutput

__version__ = "0.1.0"

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BackendCapabilities",
    "CacheCapabilities",
    "CacheSpec",
    "DefaultSampler",
    "Engine",
    "EngineConfig",
    "FinishReason",
    "GenerationResult",
    "KVCache",
    "KVCoreError",
    "LlamaModel",
    "ModelConfig",
    "Sampler",
    "SamplingParams",
    "SamplingRow",
    "StructuredOutput",
    "TokenEvent",
    "causal_mask",
    "hookimpl",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvcore' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
