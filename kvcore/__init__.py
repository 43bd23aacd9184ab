"""kvcore: swap attention implementations and KV caches under one generation driver."""

from kvcore.attention import AttentionBackend, AttentionMetadata, BackendCapabilities, causal_mask
from kvcore.engine import Engine, EngineConfig
from kvcore.errors import KVCoreError
from kvcore.hookspecs import hookimpl
from kvcore.kv_cache import CacheCapabilities, CacheSpec, KVCache
from kvcore.model import LlamaModel
from kvcore.model_config import ModelConfig
from kvcore.request import FinishReason, GenerationResult, TokenEvent
from kvcore.sampling import DefaultSampler, Sampler, SamplingParams, SamplingRow

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
    "TokenEvent",
    "causal_mask",
    "hookimpl",
]
