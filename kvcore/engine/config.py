"""How an engine runs, and the choice of backends, KV cache and sampler it implies."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from kvcore.engine.fields import EngineFields
from kvcore.engine.file_config import OPTION_TABLES
from kvcore.errors import BackendUnavailableError, ConfigError, PluginError, reject_unknown_keywords
from kvcore.interfaces.attention import AttentionBackend
from kvcore.interfaces.kv_cache import CacheSpec, KVCache
from kvcore.interfaces.layer_attention import VARIANTS
from kvcore.interfaces.setting import check_declared
from kvcore.kernels.quant import check_runnable, check_weight_format
from kvcore.model.config import DEFAULT_MAX_MODEL_LEN
from kvcore.model.lm_head import check_lm_head
from kvcore.plugins.registry import KV_CACHE, PluginEntry, PluginRegistry

__all__ = ["AUTO", "EngineConfig", "Components", "parse_dtype", "select_components", "check_device", "check_memory",
           "check_cache_memory", "check_option_tables", "DTYPES"]

#: a setting left to kvcore (kvcore.engine.defaults decides it)
AUTO = "auto"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    key = aliases.get(str(name), str(name))
    if key not in DTYPES:
        raise ConfigError(f"unknown dtype '{name}' (choose from: {', '.join(DTYPES)})")
    return DTYPES[key]


@reject_unknown_keywords
@dataclass
class EngineConfig(EngineFields):
    """How the engine runs: the fields of :class:`~kvcore.engine.fields.EngineFields` (each one a config-file key
    and, most, a CLI flag), checked here, where torch is at hand."""

    #: default cap on max_model_len so a contiguous cache does not reserve the full 8K window per slot
    DEFAULT_MAX_MODEL_LEN = DEFAULT_MAX_MODEL_LEN

    def __post_init__(self) -> None:
        # "auto" settings are checked once decided (kvcore.engine.defaults.choose_defaults)
        dtype = None if self.dtype == AUTO else parse_dtype(self.dtype)
        if dtype is None:
            check_weight_format(self.weights)
        else:
            check_runnable(self.weights, dtype, self.device)
        if self.lm_head != AUTO:
            check_lm_head(self.lm_head, dtype or torch.bfloat16, self.device)
        check_declared(self, ConfigError)  # types and least values, as the fields declare them
        names = self.attention_variants
        if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(f"attention_variants must be a list of variant names, got {names!r}")
        if len(set(names)) != len(names):
            raise ConfigError(f"attention_variants names a variant twice: {list(names)}")
        self.attention_variants = tuple(names)  # TOML and JSON give lists
        check_device(self.device)


def check_device(name: str) -> torch.device:
    """``name`` as a torch device this torch build and machine can use, or a ConfigError saying why not."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device '{name}' (examples: cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device '{name}' is not available: torch.cuda.is_available() is False")
    if device.type != "cpu":  # mps, xpu, cuda:7 ...: this torch build or machine may lack it
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError, ValueError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            reason = first.split(". ")[0][:200]  # torch's dispatcher errors run on for a screen
            raise ConfigError(f"device '{name}' is not available with this torch build or machine: {reason}") from None
    return device


def check_memory(what: str, num_bytes: int, device: torch.device, hint: str) -> None:
    """Refuse an allocation of ``num_bytes`` that cannot fit the device's total memory (before trying it: a
    huge request would otherwise fail deep in the allocator, or swap the machine to a halt)."""
    total = None
    if device.type == "cpu":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = None
    elif device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
    if total is not None and num_bytes > total:
        raise ConfigError(
            f"{what} would take {num_bytes / 2**30:,.1f} GiB but this {device.type} device has "
            f"{total / 2**30:,.1f} GiB in all; {hint}"
        )


def check_cache_memory(cls: type[KVCache], spec: CacheSpec, options: dict[str, Any] | None) -> None:
    """A KV cache (class ``cls``, sizes ``spec``) bigger than the device's memory is a ConfigError naming the
    settings to lower, raised before allocating."""
    if cls.paged and (options or {}).get("block_size") is not None:
        try:
            spec = dataclasses.replace(spec, block_size=options["block_size"])
        except ConfigError as exc:  # the table's value: the config file's line is that option's
            exc.key = ("kv_caches", cls.name, "block_size")
            raise
    block_size, num_blocks = cls.geometry(spec)
    size = cls.token_bytes(spec) * block_size * num_blocks
    hint = "lower num_blocks, kv_cache_bytes or block_size" if cls.paged else "lower max_num_seqs or max_model_len"
    unit = "blocks" if cls.paged else "sequence slots"
    check_memory(f"the '{cls.name}' KV cache ({num_blocks:,} {unit} of {block_size:,} tokens)", size, spec.device, hint)


def check_option_tables(registry: PluginRegistry, config: EngineConfig) -> None:
    """Each ``[backends.<name>]``, ``[kv_caches.<name>]`` ... section of ``config`` names a registered plugin."""
    registry.check_tables({table: getattr(config, name) for table, name in OPTION_TABLES.items()})


@dataclass(frozen=True)
class Components:
    prefill_backend: AttentionBackend
    decode_backend: AttentionBackend
    kv_cache: PluginEntry  # the cache class to allocate (both backends read its layout)


def select_components(
    registry: PluginRegistry,
    config: EngineConfig,
    *,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    variants: Collection[str] = (),
) -> Components:
    """Resolve the prefill and decode backends and the KV cache they share, or raise with the reason;
    ``variants``: the attention variants the model's layers use (each backend must serve them in its phase)."""
    check_option_tables(registry, config)
    device, dtype = torch.device(config.device), parse_dtype(config.dtype)
    shape = dict(device=device, dtype=dtype, head_dim=head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads)

    def make(name: str, phases: tuple[str, ...]) -> AttentionBackend:
        backend = registry.create(name, config.backend_options.get(name))
        reasons = backend.validate(**shape) + backend.capabilities.reasons_variants(variants, phases)
        if reasons:
            raise BackendUnavailableError(f"backend '{name}' cannot run this model here: {'; '.join(reasons)}")
        return backend

    def auto() -> str:
        usable = [
            e for e in registry.backends.values()
            if e.availability() is None and not e.cls.capabilities.reasons_unsupported(**shape)
            and not e.cls.capabilities.reasons_variants(variants)
        ]
        if config.kv_cache is not None:
            layout = registry.get(config.kv_cache, KV_CACHE).cls.layout
            usable = [e for e in usable if layout in e.cls.capabilities.kv_layouts]
        if not usable:
            cache = f" that reads the '{config.kv_cache}' KV cache" if config.kv_cache else ""
            named = [VARIANTS.get(v, f"variant '{v}'") for v in sorted(variants)]
            needs = f" with {', '.join(named)}" if variants else ""
            raise BackendUnavailableError(
                f"no registered backend{cache} supports {dtype} on {device.type}{needs}")
        return max(usable, key=lambda e: (e.cls.priority, e.name)).name

    prefill_name = config.prefill_backend or config.backend or auto()
    decode_name = config.decode_backend or config.backend or prefill_name
    if decode_name == prefill_name:
        prefill = decode = make(prefill_name, ("prefill", "decode"))
    else:
        prefill, decode = make(prefill_name, ("prefill",)), make(decode_name, ("decode",))
    if not prefill.capabilities.supports_prefill:
        raise ConfigError(f"backend '{prefill_name}' cannot run prefill")
    if not decode.capabilities.supports_decode:
        raise ConfigError(f"backend '{decode_name}' cannot run decode")
    return Components(prefill, decode, _select_cache(registry, config, prefill, decode, device, dtype))


def _select_cache(
    registry: PluginRegistry,
    config: EngineConfig,
    prefill: AttentionBackend,
    decode: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
) -> PluginEntry:
    layouts = [k for k in decode.capabilities.kv_layouts if k in prefill.capabilities.kv_layouts]
    pair = f"backend '{prefill.name}'" if prefill is decode else f"backends '{prefill.name}' and '{decode.name}'"
    if not layouts:
        raise ConfigError(
            f"prefill backend '{prefill.name}' (reads {'/'.join(prefill.capabilities.kv_layouts)} caches) and "
            f"decode backend '{decode.name}' (reads {'/'.join(decode.capabilities.kv_layouts)} caches) "
            "share no KV-cache layout; pick a compatible pair"
        )
    if config.kv_cache is not None:
        entry = registry.get(config.kv_cache, KV_CACHE)
        if entry.cls.layout not in layouts:
            raise ConfigError(
                f"KV cache '{entry.name}' has layout '{entry.cls.layout}', which {pair} cannot read "
                f"(reads: {', '.join(layouts)}); pick another --kv-cache or backend"
            )
        candidates = [entry]
    else:  # the canonical cache of each layout (named like it) first, in the backends' order of preference
        for layout in layouts:
            if (KV_CACHE.key, layout) in registry.conflicts:
                raise PluginError(registry.conflicts[(KV_CACHE.key, layout)])
        caches = registry.kv_caches.values()
        candidates = [e for lay in layouts for e in sorted(caches, key=lambda e: e.name != lay) if e.cls.layout == lay]
    reasons = []
    for entry in candidates:
        why = entry.availability() or "; ".join(entry.cls.capabilities.reasons_unsupported(device=device, dtype=dtype))
        if not why:
            return entry
        reasons.append(f"'{entry.name}': {why}")
    if not candidates:
        raise ConfigError(f"no registered KV cache has a layout {pair} reads ({', '.join(layouts)})")
    raise BackendUnavailableError(f"no KV cache {pair} can read is usable here: {'; '.join(reasons)}")
