"""What a prepared-model entry (:mod:`kvcore.loaders.model_cache`) holds besides ``model.pt``: the tensors made in
arena files (:func:`~kvcore.kernels.huge_pages.arenas_in`), read back as views of their private mappings, and the
config and tokenizer as JSON."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from kvcore.kernels.huge_pages import advise_huge_pages
from kvcore.model.config import ModelConfig
from kvcore.model.rope import RopeScaling
from kvcore.text.tokenizer import Tokenizer

__all__ = ["arena_tensors", "config_from_json", "config_to_json", "tokenizer_from_json", "tokenizer_to_json"]


def arena_tensors(entry: Path, in_arenas: dict[str, list]) -> dict[str, torch.Tensor]:
    """The tensors ``in_arenas`` describes, views of their arena files mapped privately (each advised into huge pages:
    streamed every decode step)."""
    files = {}
    for file in sorted({file for file, *_ in in_arenas.values()}):
        path = entry / file
        files[file] = torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)
        advise_huge_pages([files[file]])
    out = {}
    for name, (file, at, dtype, shape) in in_arenas.items():
        kind = getattr(torch, dtype)
        out[name] = files[file][at : at + torch.Size(shape).numel() * kind.itemsize].view(kind).view(shape)
    return out



def config_to_json(config: ModelConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def _tuples(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def config_from_json(fields: dict[str, Any]) -> ModelConfig:
    """Inverse of :func:`config_to_json`: JSON lists back to the tuples the dataclasses hold."""
    fields = dict(fields)
    rope = fields.get("rope_scaling")
    if rope is not None:
        fields["rope_scaling"] = RopeScaling(**{k: _tuples(v) for k, v in rope.items()})
    if fields.get("sliding_window_layers") is not None:
        fields["sliding_window_layers"] = tuple(fields["sliding_window_layers"])
    return ModelConfig(**fields)


def tokenizer_to_json(tok: Tokenizer) -> dict[str, Any]:
    return {
        "backend": tok.backend.to_str(),
        "bos_token_id": tok.bos_token_id,
        "eos_token_ids": list(tok.eos_token_ids),
        "pad_token_id": tok.pad_token_id,
        "add_bos": tok.add_bos,
        "chat_template": tok.chat_template,
        "recommended_sampling": tok.recommended_sampling,
    }


def tokenizer_from_json(state: dict[str, Any]) -> Tokenizer:
    import tokenizers

    backend = tokenizers.Tokenizer.from_str(state.pop("backend"))
    return Tokenizer(backend, **state)
