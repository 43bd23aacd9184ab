"""What :class:`~kvcore.engine.core.Engine` assembles from its configuration: the KV cache, sized and checked
before it is allocated, and the parts of a one-process forward (backend output guards, compiled decode
steps, the LM head format)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvcore.engine.config import EngineConfig, check_cache_memory, parse_dtype
from kvcore.errors import ConfigError
from kvcore.execution.backend_check import BackendGuard
from kvcore.interfaces.attention import AttentionBackend
from kvcore.interfaces.dtypes import dtype_name
from kvcore.interfaces.kv_cache import CacheSpec, KVCache
from kvcore.interfaces.layer_attention import LayerAttention
from kvcore.model.config import ModelConfig
from kvcore.model.decoder import LlamaModel
from kvcore.model.embedding import head_rows
from kvcore.model.layers import bind_variants
from kvcore.plugins.registry import PluginEntry, PluginRegistry
from kvcore.scheduling.kv_groups import KVGroups, group_layers
from kvcore.text.tokenizer import Tokenizer

__all__ = ["build_kv_cache", "check_model", "kv_groups", "load_model", "local_execution", "serving_config",
           "tensor_parallel_runner", "variant_layers", "prefix_namespace"]


def variant_layers(registry: PluginRegistry, config: EngineConfig, model: LlamaModel) -> tuple[LayerAttention, ...]:
    """The model's per-layer attention with ``config.attention_variants`` bound to each layer. The engine holds
    them, not the model: engines over one model object may select different variants."""
    if not config.attention_variants:
        return model.attention_layers
    if config.tensor_parallel_size > 1:  # a rank sees its own heads only: a per-head mod would read the wrong h
        raise ConfigError("attention_variants run in one process; they cannot be combined with "
                          "tensor_parallel_size > 1")
    variants = [registry.create_variant(n, config.variant_options.get(n)) for n in config.attention_variants]
    c = model.config
    return bind_variants(model.attention_layers, variants, num_heads=c.num_attention_heads,
                         num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim)


def prefix_namespace(
    model: LlamaModel, dtype: torch.dtype, weight_format: str, cache_name: str, config: EngineConfig
) -> str:
    """What prefix-cache keys name besides the tokens. One cache serves one engine, but a key never means the same
    tokens under another model, dtype, weight format, cache layout or attention-variant selection (with options)."""
    variants = [(n, sorted(config.variant_options.get(n, {}).items())) for n in config.attention_variants]
    return f"{model.config!r}|{dtype}|{weight_format}|{cache_name}|{variants!r}"


def kv_groups(
    layers: Sequence[LayerAttention], num_layers: int, config: EngineConfig, entry: PluginEntry, max_model_len: int
) -> tuple[KVGroups, str]:
    """The block-table groups of a model's layers (``layers``: its attention) and whether sliding-window
    layers give blocks back: "on", or "off: why"."""
    if not any(a.sliding_window is not None and a.sliding_window < max_model_len for a in layers):
        reason = "off: no layer has a sliding window shorter than max_model_len"
    elif not config.free_window_blocks:
        reason = "off: free_window_blocks is false"
    elif entry.cls.capabilities.no_window_pool is not None:
        reason = f"off: KV cache '{entry.name}': {entry.cls.capabilities.no_window_pool}"
    else:
        reason = "on"
    return group_layers(layers, num_layers, max_model_len, free_window_blocks=reason == "on"), reason


def build_kv_cache(
    registry: PluginRegistry, entry: PluginEntry, config: EngineConfig, mc: ModelConfig, max_model_len: int,
    groups: KVGroups | None = None,
) -> tuple[KVCache, str]:
    """The KV cache ``entry`` names, for this process's share of the model ``mc`` (its local heads under
    tensor parallelism), and its name. ``groups``: the layers' block-table groups (:func:`kv_groups`). Without
    ``num_blocks``, ``kv_cache_bytes`` sizes a paged cache, else window groups size it for ``max_num_seqs``
    sequences of ``max_model_len`` at their peak; the memory is checked before anything is allocated."""
    dtype, device = parse_dtype(config.dtype), torch.device(config.device)
    spec = CacheSpec(
        num_layers=mc.num_hidden_layers,
        num_kv_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim,
        dtype=dtype,
        device=device,
        max_num_seqs=config.max_num_seqs,
        max_seq_len=max_model_len,
        block_size=config.block_size,
        num_blocks=config.num_blocks,
        layer_storage=groups.layer_storage if groups is not None else None,
    )
    cache_name, cache_options = entry.name, config.kv_cache_options.get(entry.name)
    block_size = (cache_options or {}).get("block_size", config.block_size)
    if config.kv_cache_bytes and not config.num_blocks:
        if not entry.cls.paged:
            raise ConfigError(f"kv_cache_bytes sizes a paged cache; '{cache_name}' reserves one slot per sequence")
        per_block = entry.cls.token_bytes(spec) * block_size
        spec = dataclasses.replace(spec, num_blocks=max(1, config.kv_cache_bytes // per_block))
    elif groups is not None and groups.has_windows and not config.num_blocks:
        chunk = config.max_num_batched_tokens if config.enable_chunked_prefill else None
        per_seq = groups.blocks_per_sequence(max_model_len, block_size, chunk)
        spec = dataclasses.replace(spec, num_blocks=config.max_num_seqs * per_seq)
    check_cache_memory(entry.cls, spec, cache_options)
    cache = registry.create_cache(cache_name, spec, cache_options)
    return cache, cache_name


def local_execution(
    model: LlamaModel, config: EngineConfig, backends: Sequence[AttentionBackend], device: torch.device, *,
    tensor_parallel: bool,
) -> tuple[dict[int, BackendGuard], Any, Any]:
    """A one-process forward's guards (``id(backend)`` → its :class:`BackendGuard`), compiled decode steps
    (EngineConfig.compile, else None) and LM head (EngineConfig.lm_head "int4", else None: dense), for
    ``backends`` = (prefill, decode). Compiling and the int4 head run in one process only."""
    # one guard per backend instance: it remembers which kinds of forward it verified (one-process runs)
    checked = config.check_backend_outputs and config.tensor_parallel_size == 1
    guards = {id(b): BackendGuard(b, config.backend_check_interval)
              for b in backends if checked}
    compiled = head = None
    for option, value in (("compile", config.compile), ("lm_head", config.lm_head != "dense")):
        if value and tensor_parallel:
            raise ConfigError(f"{option} runs in one process; it cannot be combined with tensor_parallel_size > 1")
    if config.compile:
        from kvcore.execution.compile import CompiledDecode

        compiled = CompiledDecode(backends[-1], device)
    if config.lm_head == "int8":
        from kvcore.model.lm_head import Int8Head

        head = Int8Head(head_rows(model), linear=getattr(model, "head_int8", None))
        model.head_int8 = head.linear  # made once per model, however many engines run it
    if config.lm_head == "int4":
        from kvcore.model.lm_head import RescoredInt4Head

        a8 = getattr(model, "weight_format", "") in ("int4a8", "gguf")
        head = RescoredInt4Head(head_rows(model), a8=a8, int4=getattr(model, "head_int4", None) if a8 else None)
        if a8:
            model.head_int4 = head.int4  # made once per model, however many engines run it
    return guards, compiled, head


def load_model(
    model: str, config: EngineConfig, model_cache: bool | None, request_tokens: Callable[[Tokenizer], int] | None,
) -> tuple[LlamaModel, Tokenizer, EngineConfig]:
    """Load ``model`` for an engine of ``config`` (see :meth:`~kvcore.engine.core.Engine.from_pretrained`): the
    decoder, its tokenizer, and ``config`` with ``max_model_len`` sized to ``request_tokens`` when it has none."""
    from kvcore.loaders.heap import trim_heap
    from kvcore.loaders.model_cache import load_pretrained

    decoder, tokenizer = load_pretrained(
        model, parse_dtype(config.dtype), config.device, config.max_model_len, model_cache, config.weights,
        config.lm_head
    )
    trim_heap()
    if request_tokens is not None and config.max_model_len is None:
        window = decoder.config.max_position_embeddings
        config = dataclasses.replace(config, max_model_len=min(window, max(2, request_tokens(tokenizer))))
    return decoder, tokenizer, config


def check_model(model: LlamaModel, config: EngineConfig) -> str:
    """That ``model`` is what ``config`` asks for (dtype, weight format); returns its weight format."""
    dtype = parse_dtype(config.dtype)
    if model.dtype != dtype:
        raise ConfigError(f"model weights are {model.dtype} but the engine was configured for {dtype}")
    weight_format = getattr(model, "weight_format", "float")
    if config.weights not in ("auto", weight_format):
        raise ConfigError(f"model weights are {weight_format} but the engine was configured for {config.weights}")
    return weight_format


def tensor_parallel_runner(model: LlamaModel, config: EngineConfig) -> Any:
    """With ``tensor_parallel_size > 1``, rank 0's side of the group (this process computes rank 0's shard;
    its ``model`` is that shard); else None."""
    if config.tensor_parallel_size == 1:
        return None
    # imported here: spawning and process groups only for the tensor-parallel engines that use them
    from kvcore.execution.distributed import TensorParallelRunner
    from kvcore.execution.distributed.sharding import check_shardable

    check_shardable(model)  # before any process is spawned
    return TensorParallelRunner(model, config)


def serving_config(engine: Any) -> dict[str, Any]:
    """What serves ``engine``'s requests: backends, KV cache, sampler, dtype, weights, device, limits, the
    speculative-decoding proposer with its drafts per step (``None`` when speculation is off) and the attention
    variants selected."""
    speculator = getattr(engine, "speculator", None)
    return {
        "prefill_backend": engine.prefill_backend.name,
        "decode_backend": engine.decode_backend.name,
        "kv_cache": engine.kv_cache_name,
        "sampler": engine.sampler.name,
        "dtype": dtype_name(engine.dtype),
        "weights": getattr(engine.model, "weight_format", "float"),
        "device": str(engine.device),
        "max_num_seqs": engine.config.max_num_seqs,
        "max_model_len": engine.max_model_len,
        "window_pool": engine.kv.window_pool,
        "proposer": speculator.proposer.name if speculator else None,
        "num_speculative_tokens": speculator.num_tokens if speculator else None,
        "attention_variants": list(engine.config.attention_variants),
    }
