"""The sampling settings a model's own files recommend, as :class:`~kvcore.interfaces.sampler.SamplingParams` fields.

Chat (:mod:`kvcore.sampling.chat_defaults`) uses them in place of kvcore's defaults. Where they come from:

* a GGUF file's ``general.sampling.*`` keys (gguf-py's ``Keys.General.SAMPLING_*``, which llama.cpp reads as the
  model's defaults): ``temp``, ``top_k``, ``top_p``, ``min_p``, ``penalty_repeat``, ``penalty_last_n``
  (llama.cpp's -1 = the whole context, 0 = no repetition penalty);
* a Hugging Face directory's ``generation_config.json``: ``temperature``, ``top_k``, ``top_p``, ``min_p``,
  ``repetition_penalty`` (the keys vLLM's ``--generation-config auto`` reads; ``do_sample`` is not consulted,
  as there).

A value of the wrong type or out of range is a :class:`~kvcore.errors.ModelLoadError` naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvcore.errors import InvalidRequestError, ModelLoadError

__all__ = ["from_gguf", "from_generation_config"]

#: GGUF key -> SamplingParams field
GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
_GGUF_LAST_N = "general.sampling.penalty_last_n"
#: generation_config.json keys that are SamplingParams fields of the same name
HF_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def from_gguf(metadata: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The recommended settings among a GGUF file's metadata (``where``: the file, for messages)."""
    out = {field: metadata[key] for key, field in GGUF_KEYS.items() if metadata.get(key) is not None}
    names = {field: key for key, field in GGUF_KEYS.items()}
    last_n = metadata.get(_GGUF_LAST_N)
    if last_n is not None:
        names["repetition_window"] = _GGUF_LAST_N
        if last_n == 0:  # llama.cpp: no repetition penalty
            out["repetition_penalty"] = 1.0
        else:  # -1: the whole context, kvcore's None
            out["repetition_window"] = None if last_n == -1 else last_n
    return _checked(out, names, where)


def from_generation_config(generation: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    """The recommended settings of a parsed ``generation_config.json`` (None: no such file)."""
    out = {key: generation[key] for key in HF_KEYS if generation and generation.get(key) is not None}
    return _checked(out, {key: f"generation_config.json: {key}" for key in HF_KEYS}, where)


def _checked(values: dict[str, Any], names: dict[str, str], where: str) -> dict[str, Any]:
    from kvcore.interfaces.sampler import SamplingParams

    for field, value in values.items():
        if value is None:  # repetition_window: the whole context
            continue
        if field in ("top_k", "repetition_window") and isinstance(value, float) and value.is_integer():
            values[field] = value = int(value)
        try:
            SamplingParams(**{field: value})
        except (InvalidRequestError, TypeError) as exc:
            raise ModelLoadError(f"'{where}': {names[field]} is not a usable sampling setting: {exc}") from None
    return values
