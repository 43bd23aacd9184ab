"""kvcore: swap attention implementations and KV caches under one generation driver."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvcore.version import __version__ as __version__  # re-exported

# The public names load on first use (PEP 562): `import kvcore.cli` or `kvcore.errors` stays light (no
# torch), so the CLI can answer --help at once and handle a Ctrl-C while torch loads.
_EXPORTS = {
    "AttentionBackend": "kvcore.interfaces.attention",
    "AttentionMetadata": "kvcore.interfaces.metadata",
    "BackendCapabilities": "kvcore.interfaces.attention",
    "causal_mask": "kvcore.interfaces.attention",
    "Engine": "kvcore.engine.core",
    "EngineConfig": "kvcore.engine.config",
    "Settings": "kvcore.engine.settings",
    "load_settings": "kvcore.engine.settings",
    "KVCoreError": "kvcore.errors",
    "hookimpl": "kvcore.hookspecs",
    "CacheCapabilities": "kvcore.interfaces.kv_cache",
    "CacheSpec": "kvcore.interfaces.kv_cache",
    "KVCache": "kvcore.interfaces.kv_cache",
    "LlamaModel": "kvcore.model.decoder",
    "ModelConfig": "kvcore.model.config",
    "Proposal": "kvcore.interfaces.proposer",
    "Proposer": "kvcore.interfaces.proposer",
    "FinishReason": "kvcore.scheduling.request",
    "GenerationResult": "kvcore.scheduling.request",
    "TokenEvent": "kvcore.scheduling.request",
    "DefaultSampler": "kvcore.sampling.sampler",
    "Sampler": "kvcore.interfaces.sampler",
    "SamplingParams": "kvcore.interfaces.sampler",
    "SamplingRow": "kvcore.interfaces.sampler",
    "StructuredOutput": "kvcore.interfaces.structured",
}

if TYPE_CHECKING:
    from kvcore.engine.config import EngineConfig
    from kvcore.engine.core import Engine
    from kvcore.engine.settings import Settings, load_settings
    from kvcore.errors import KVCoreError
    from kvcore.hookspecs import hookimpl
    from kvcore.interfaces.attention import AttentionBackend, BackendCapabilities, causal_mask
    from kvcore.interfaces.kv_cache import CacheCapabilities, CacheSpec, KVCache
    from kvcore.interfaces.metadata import AttentionMetadata
    from kvcore.interfaces.proposer import Proposal, Proposer
    from kvcore.interfaces.sampler import Sampler, SamplingParams, SamplingRow
    from kvcore.interfaces.structured import StructuredOutput
    from kvcore.model.config import ModelConfig
    from kvcore.model.decoder import LlamaModel
    from kvcore.sampling.sampler import DefaultSampler
    from kvcore.scheduling.request import FinishReason, GenerationResult, TokenEvent


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
    "Proposal",
    "Proposer",
    "Sampler",
    "SamplingParams",
    "SamplingRow",
    "Settings",
    "StructuredOutput",
    "TokenEvent",
    "causal_mask",
    "hookimpl",
    "load_settings",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvcore' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
