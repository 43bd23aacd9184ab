"""Load a Hugging Face model directory (config.json + safetensors + tokenizer.json) of any registered
architecture (:mod:`kvcore.model.architectures`).

Expected files::

    config.json                    e.g. LlamaForCausalLM / model_type "llama", Qwen2ForCausalLM...
    model.safetensors              or model-0000x-of-0000n.safetensors + model.safetensors.index.json
    tokenizer.json                 the fast tokenizer
    tokenizer_config.json          optional: bos/eos/pad tokens, add_bos_token, chat_template
    chat_template.jinja            optional: the chat template (newer transformers write it here)
    generation_config.json         optional: eos_token_id (the ids generation stops on); temperature, top_k,
                                   top_p, min_p, repetition_penalty (chat's defaults: kvcore.loaders.recommended)

Tensors are read with ``safetensors.safe_open`` (no pickle) and converted to float32.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kvcore.errors import ModelLoadError, ModelNotFoundError
from kvcore.loaders.loaded import LoadedModel, check_layer_count, expected_shapes, split_rows, stored_tensors
from kvcore.loaders.recommended import from_generation_config
from kvcore.model.architectures import Architecture
from kvcore.model.config import ModelConfig
from kvcore.plugins.architectures import for_hf_config
from kvcore.text.tokenizer import Tokenizer

__all__ = ["load_hf_dir"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: largest JSON side file read (config.json, tokenizer_config.json, the shard index...): real ones are KBs
MAX_JSON_BYTES = 64 * 1024 * 1024

#: checkpoint entries that are buffers, not parameters (old Llama checkpoints saved RoPE's inv_freq)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_json(path: Path, required: bool = True) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"'{path.parent}' has no {path.name}: not a Hugging Face model directory")
        return None
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise ModelLoadError(f"'{path}' is larger than {MAX_JSON_BYTES} bytes; is it really {path.name}?")
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelLoadError(f"cannot read '{path}': {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"'{path}' is not valid JSON: {exc}") from None
    except RecursionError:
        raise ModelLoadError(f"'{path}' nests JSON too deeply") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"'{path}' must hold a JSON object")
    return data


def _read_text(path: Path) -> str:
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise ModelLoadError(f"'{path}' is larger than {MAX_JSON_BYTES} bytes")
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelLoadError(f"cannot read '{path}': {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"'{path}' is not UTF-8 text: {exc}") from None


def _tensor_names(files: list[Path]) -> list[str]:
    """Every tensor name in the safetensors headers (no data read)."""
    names: list[str] = []
    for file in files:
        try:
            with safe_open(os.fspath(file), framework="pt") as f:
                names.extend(f.keys())
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"'{file}' is not a valid safetensors file (truncated or corrupt?): {exc}") from None
    return names


def _eos_ids(value: object) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _config(
    cfg: dict[str, Any], generation: dict[str, Any] | None, path: Path
) -> tuple[type[Architecture], ModelConfig]:
    arch = for_hf_config(cfg, str(path))
    eos = generation.get("eos_token_id") if generation else None
    try:
        return arch, arch.config_from_hf(cfg, eos, str(path))
    except ModelLoadError as exc:
        message = str(exc)
        raise ModelLoadError(message if str(path) in message else f"'{path}': {message}") from None
    except (TypeError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"'{path}': malformed config.json: {exc}") from None


def _shard_files(path: Path) -> list[Path]:
    """The safetensors files holding the weights, from the index when the checkpoint is sharded."""
    index = _read_json(path / "model.safetensors.index.json", required=False)
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"'{path}': model.safetensors.index.json has no weight_map")
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"'{path}': shard '{file.name}' listed in the index is missing")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"'{path}' has no model.safetensors (or *.safetensors shards): kvcore loads safetensors only"
        )
    return files


def _read_tensors(
    files: list[Path], shapes: dict[str, tuple[int, ...]], stored: dict[str, list[str]], arch: str
) -> dict[str, torch.Tensor]:
    """Read every expected tensor as float32 (fused ones cut into their canonical parts), checking names,
    dtypes and shapes."""
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(os.fspath(file), framework="pt") as f:
                for key in f.keys():
                    if key.endswith(_IGNORED_SUFFIXES):
                        continue
                    if key == "lm_head.weight" and key not in stored:
                        continue  # tied: some checkpoints store the head anyway
                    if key not in stored:
                        if key.endswith(".bias"):
                            raise ModelLoadError(f"'{file}': unsupported: bias tensor '{key}'")
                        raise ModelLoadError(f"'{file}': unexpected tensor '{key}' for a {arch} model")
                    tensor = f.get_tensor(key)
                    parts = stored[key]
                    expected = (sum(shapes[n][0] for n in parts), *shapes[parts[0]][1:])
                    if tuple(tensor.shape) != expected:
                        raise ModelLoadError(
                            f"'{file}': tensor '{key}' has shape {list(tensor.shape)}, "
                            f"expected {list(expected)} from config.json"
                        )
                    if tensor.dtype not in _FLOAT_DTYPES:
                        raise ModelLoadError(
                            f"'{file}': tensor '{key}' has unsupported dtype {tensor.dtype} "
                            "(supported: float32, float16, bfloat16)"
                        )
                    for name, part in split_rows(tensor.to(torch.float32), parts, shapes).items():
                        weights[name] = part.contiguous()
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(
                f"'{file}' is not a valid safetensors file (truncated or corrupt?): {exc}"
            ) from None
    missing = [name for name in shapes if name not in weights]
    if missing:
        raise ModelLoadError(f"missing tensor '{missing[0]}' ({len(missing)} missing in all)")
    return {name: weights[name] for name in shapes}


def _tokenizer(path: Path, generation: dict[str, Any] | None, config: ModelConfig) -> Tokenizer:
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(f"'{path}' has no tokenizer.json (kvcore needs the fast-tokenizer file)")
    tokenizer_config = _read_json(path / "tokenizer_config.json", required=False)
    template_file = path / "chat_template.jinja"
    chat_template = _read_text(template_file) if template_file.is_file() else None
    eos = _eos_ids(generation.get("eos_token_id") if generation else None) or config.eos_token_ids
    return Tokenizer.from_file(
        tokenizer_file, tokenizer_config=tokenizer_config, chat_template=chat_template, eos_token_ids=eos,
        recommended_sampling=from_generation_config(generation, str(path)),
    )


def load_hf_dir(path: str | os.PathLike[str], name: str | None = None) -> LoadedModel:
    """Load a Hugging Face model directory: config, float32 weights (canonical names), tokenizer.

    Args:
        path: the directory.
        name: display name; defaults to the directory's name.
    """
    path = Path(path)
    if not path.is_dir():
        raise ModelNotFoundError(f"model directory '{path}' not found")
    effective = os.access in os.supports_effective_ids  # a setuid process reads with its effective uid
    if not os.access(path, os.R_OK | os.X_OK, effective_ids=effective):  # else its files fail one by one
        raise ModelLoadError(f"cannot read model directory '{path}': permission denied")
    cfg = _read_json(path / "config.json") or {}  # required: raises when the file is missing
    generation = _read_json(path / "generation_config.json", required=False)
    arch, config = _config(cfg, generation, path)
    tokenizer = _tokenizer(path, generation, config)
    files = _shard_files(path)
    check_layer_count(config, _tensor_names(files), "model.layers.{i}.", f"'{path}'")
    shapes = expected_shapes(config)
    stored = stored_tensors(shapes, config.num_hidden_layers, arch.layer_names("hf"))
    weights = _read_tensors(files, shapes, stored, arch.name)
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        source=str(path),
        name=name or path.resolve().name,
    )
