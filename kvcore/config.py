"""The TOML config file: run settings plus per-backend and per-plugin option tables.

Example ``kvcore.toml``::

    backend = "sdpa"            # or prefill_backend / decode_backend
    model = "smollm2"
    dtype = "float32"
    max_new_tokens = 64
    temperature = 0.0

    [backends.paged]
    block_size = 32

    [plugins.my_plugin]
    some_option = true
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvcore.errors import ConfigError

__all__ = ["FileConfig", "load_config"]


@dataclass
class FileConfig:
    backend: str | None = None
    prefill_backend: str | None = None
    decode_backend: str | None = None
    model: str | None = None
    dtype: str | None = None
    device: str | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    backends: dict[str, dict[str, Any]] = field(default_factory=dict)  # [backends.<name>] → constructor kwargs
    plugins: dict[str, dict[str, Any]] = field(default_factory=dict)  # [plugins.<name>] → kvcore_configure


_TYPES: dict[str, tuple[type, ...]] = {
    "backend": (str,),
    "prefill_backend": (str,),
    "decode_backend": (str,),
    "model": (str,),
    "dtype": (str,),
    "device": (str,),
    "max_new_tokens": (int,),
    "temperature": (int, float),
    "top_k": (int,),
    "top_p": (int, float),
    "seed": (int,),
    "ignore_eos": (bool,),
    "max_num_seqs": (int,),
    "max_model_len": (int,),
    "block_size": (int,),
    "num_blocks": (int,),
}


def load_config(path: str | Path) -> FileConfig:
    """Read and validate a config file; unknown keys and wrong types are errors naming the key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' not found")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file '{path}' is not valid TOML: {exc}") from None
    known = {f.name for f in fields(FileConfig)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"config file '{path}': unknown key '{key}' (known: {', '.join(sorted(known))})")
        if key in ("backends", "plugins"):
            if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
                raise ConfigError(f"config file '{path}': '{key}' must hold tables like [{key}.<name>]")
        else:
            types = _TYPES[key]
            if isinstance(value, bool) and bool not in types or not isinstance(value, types):
                expected = " or ".join(t.__name__ for t in types)
                raise ConfigError(f"config file '{path}': key '{key}' must be {expected}, got {value!r}")
        values[key] = value
    return FileConfig(**values)
