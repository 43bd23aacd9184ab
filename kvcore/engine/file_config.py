"""The TOML config file: run settings plus per-backend, per-cache, per-sampler and per-plugin option tables.

Example ``kvcore.toml``::

    backend = "paged"           # or prefill_backend / decode_backend
    kv_cache = "int8"           # a KV-cache layout the backend reads (default: the backend's own)
    sampler = "default"
    model = "smollm2"
    dtype = "float32"
    weights = "auto"            # or float / int8 / int4 (weight-only quantized matmuls, bfloat16 on CPU)
    lm_head = "dense"           # or int4 (int4 scores, the top 64 rescored densely; bfloat16 on CPU)
    compile = false             # torch.compile the decode steps
    proposer = "ngram"          # speculative decoding (docs/speculative.md)
    attention_variants = ["alibi"]  # registered attention variants (docs/attention-variants.md)
    max_new_tokens = 64
    temperature = 0.0

    [kv_caches.int8]            # keyword arguments for that cache's constructor
    block_size = 32

    [variants.alibi]            # keyword arguments for that attention variant's constructor
    max_bias = 8.0

    [plugins.my_plugin]         # handed to that plugin's kvcore_configure hook
    some_option = true

Every scalar key is a field of :class:`FileConfig`; its annotation is the type the file must give.
"""

from __future__ import annotations

import re
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvcore.errors import ConfigError, did_you_mean

__all__ = ["FileConfig", "load_config", "OPTION_TABLES"]

#: config tables of per-name constructor options, and the EngineConfig field each one fills
OPTION_TABLES = {"backends": "backend_options", "kv_caches": "kv_cache_options", "samplers": "sampler_options",
                 "proposers": "proposer_options", "variants": "variant_options"}


@dataclass
class FileConfig:
    backend: str | None = None
    prefill_backend: str | None = None
    decode_backend: str | None = None
    kv_cache: str | None = None
    sampler: str | None = None
    model: str | None = None
    dtype: str | None = None
    device: str | None = None
    weights: str | None = None  # matmul weight format: auto, float, int8, int4 (kvcore.kernels.quant)
    lm_head: str | None = None  # LM head format: dense, int4 (kvcore.model.lm_head)
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    stop: list[str] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    repetition_window: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: int | None = None
    threads: int | None = None  # torch CPU threads (CLI); default: the cores not busy with other work
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    tensor_parallel_size: int | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    free_window_blocks: bool | None = None  # sliding-window layers give dead KV blocks back (paged caches)
    check_backend_outputs: bool | None = None  # check attention outputs (kvcore/execution/backend_check.py)
    backend_check_interval: int | None = None  # forwards between reference checks of layer 0
    compile: bool | None = None  # torch.compile the decode steps (kvcore/execution/compile.py)
    proposer: str | None = None  # speculative decoding: the proposer (docs/speculative.md)
    num_speculative_tokens: int | None = None  # draft tokens verified per step and request
    attention_variants: list[str] | None = None  # registered attention variants, applied in order
    backends: dict[str, dict[str, Any]] = field(default_factory=dict)  # [backends.<name>] → constructor kwargs
    kv_caches: dict[str, dict[str, Any]] = field(default_factory=dict)  # [kv_caches.<name>] → constructor kwargs
    samplers: dict[str, dict[str, Any]] = field(default_factory=dict)  # [samplers.<name>] → constructor kwargs
    proposers: dict[str, dict[str, Any]] = field(default_factory=dict)  # [proposers.<name>] → constructor kwargs
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)  # [variants.<name>] → constructor kwargs
    plugins: dict[str, dict[str, Any]] = field(default_factory=dict)  # [plugins.<name>] → kvcore_configure


def _scalar_types(annotation: Any) -> tuple[type, ...]:
    """``int | None`` → ``(int,)``; a float key also takes an int."""
    args = [typing.get_origin(a) or a for a in typing.get_args(annotation) if a is not types.NoneType]
    return (int, float) if args == [float] else tuple(args)


_HINTS = typing.get_type_hints(FileConfig)
_TABLES = (*OPTION_TABLES, "plugins")
_TYPES = {f.name: _scalar_types(_HINTS[f.name]) for f in fields(FileConfig) if f.name not in _TABLES}


def load_config(path: str | Path) -> FileConfig:
    """Read and validate a config file; unknown keys and wrong types are errors naming the key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file '{path}' is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    except OSError as exc:  # unreadable (permissions), a device, ...
        raise ConfigError(f"cannot read config file '{path}': {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file '{path}' is not valid TOML: {exc}") from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise ConfigError(f"config file '{path}' is not valid TOML: values nested too deeply") from None
    known = {f.name for f in fields(FileConfig)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        where = f"config file '{path}'{_line_of(text, key)}"
        if isinstance(value, dict) and key not in _TABLES:  # a [section] whose name is no table's
            sub = next((k for k, v in value.items() if isinstance(v, dict)), None)
            section = f"[{key}.{sub}]" if sub else f"[{key}]"
            hint = did_you_mean(key, _TABLES) or f" (sections: {', '.join(f'[{t}.<name>]' for t in _TABLES)})"
            raise ConfigError(f"{where}: unknown section {section}{hint}")
        if key not in known:
            raise ConfigError(f"{where}: unknown key '{key}' (known: {', '.join(sorted(known))})"
                              f"{did_you_mean(key, known)}")
        if key in _TYPES:
            types_ = _TYPES[key]
            is_strings = not isinstance(value, list) or all(isinstance(v, str) for v in value)
            if isinstance(value, bool) and bool not in types_ or not isinstance(value, types_) or not is_strings:
                expected = " or ".join(t.__name__ for t in types_)
                raise ConfigError(f"{where}: key '{key}' must be {expected}, got {value!r}")
        elif not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
            raise ConfigError(f"{where}: '{key}' must hold tables like [{key}.<name>]")
        values[key] = value
    return FileConfig(**values)


def _line_of(text: str, key: str) -> str:
    """``", line N"`` of the first line that sets top-level ``key`` or opens a ``[key...]`` table, or ``""``:
    tomllib reports lines for syntax errors only, and a long file's wrong key is easier found by line."""
    pattern = re.compile(rf"^\s*(\[\[?\s*{re.escape(key)}\s*[.\]]|{re.escape(key)}\s*=)")
    for number, line in enumerate(text.splitlines(), 1):
        if pattern.match(line):
            return f", line {number}"
    return ""
