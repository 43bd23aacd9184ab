"""The parts an :class:`~kvcore.engine.core.Engine` is assembled from, chosen for one model and configuration:
each layer's attention, the backends, the executor that runs a forward, the sampler and the KV cache with its
manager (:func:`assemble`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.engine.build import (
    build_kv_cache,
    check_model,
    kv_groups,
    local_execution,
    prefix_namespace,
    tensor_parallel_runner,
    variant_layers,
)
from kvcore.engine.config import EngineConfig, select_components
from kvcore.execution.compile import CompiledDecode
from kvcore.execution.runner import Executor, ModelRunner
from kvcore.interfaces.attention import AttentionBackend
from kvcore.interfaces.layer_attention import LayerAttention, variants_of
from kvcore.interfaces.sampler import Sampler
from kvcore.model.config import ModelConfig, check_max_model_len
from kvcore.model.decoder import LlamaModel
from kvcore.model.lm_head import LMHead
from kvcore.plugins.registry import PluginRegistry
from kvcore.scheduling.kv_manager import KVCacheManager

__all__ = ["Assembly", "assemble"]


@dataclass
class Assembly:
    """What :func:`assemble` chose and built."""

    attention_layers: tuple[LayerAttention, ...]  # the model's, with config.attention_variants bound
    prefill_backend: AttentionBackend
    decode_backend: AttentionBackend
    runner: Executor  # here, or every rank of the tensor-parallel group
    compiled_decode: CompiledDecode | None
    lm_head: LMHead | None  # None: dense
    sampler: Sampler
    max_model_len: int
    kv: KVCacheManager
    kv_cache_name: str
    model_config: ModelConfig  # under tensor parallelism this rank's: its local heads


def assemble(
    registry: PluginRegistry, config: EngineConfig, model: LlamaModel, sampler: Sampler | None, dtype: torch.dtype,
    device: torch.device,
) -> Assembly:
    """Choose and build ``config``'s parts for ``model`` (``sampler``: one given in place of ``config.sampler``);
    the executor is started on the backends and cache."""
    weight_format = check_model(model, config)
    layers = variant_layers(registry, config, model)
    tp_runner = tensor_parallel_runner(model, config)
    mc = tp_runner.model.config if tp_runner is not None else model.config  # backends and cache see local heads
    chosen = select_components(registry, config, head_dim=mc.head_dim, variants=variants_of(layers),
                               num_heads=mc.num_attention_heads, num_kv_heads=mc.num_key_value_heads)
    backends = (chosen.prefill_backend, chosen.decode_backend)
    guards, compiled, head = local_execution(model, config, backends, device, tensor_parallel=tp_runner is not None)
    runner: Executor = tp_runner or ModelRunner(model, guards, compiled, head)
    sampler = sampler or registry.create_sampler(config.sampler, config.sampler_options.get(config.sampler))
    window = mc.max_position_embeddings
    check_max_model_len(config.max_model_len, window)
    max_model_len = config.max_model_len or min(window, EngineConfig.DEFAULT_MAX_MODEL_LEN)
    groups, window_pool = kv_groups(layers, mc.num_hidden_layers, config, chosen.kv_cache, max_model_len)
    cache, cache_name = build_kv_cache(registry, chosen.kv_cache, config, mc, max_model_len, groups)
    runner.start(*backends, cache, config)
    namespace = prefix_namespace(model, dtype, weight_format, cache_name, config)
    kv = KVCacheManager(cache, enable_prefix_caching=config.enable_prefix_caching, namespace=namespace,
                        groups=groups, window_pool=window_pool)
    return Assembly(layers, *backends, runner, compiled, head, sampler, max_model_len, kv, cache_name, mc)
