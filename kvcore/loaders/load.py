"""Model loading: turn a model spec into a config, float32 weights and a tokenizer.

A spec is ``"smollm2"`` (the embedded default, SmolLM2-135M-Instruct), a ``.gguf`` file, or a
Hugging Face model directory, of any registered architecture (:mod:`kvcore.model.architectures`). Every loader
produces the same :class:`LoadedModel`: weights under kvcore's canonical (Hugging Face ``LlamaForCausalLM``)
parameter names, in Hugging Face's layout, as float32 CPU tensors, so the rest of kvcore never needs to
know where a model came from. :func:`build_model` turns it into a :class:`~kvcore.model.decoder.DecoderModel`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvcore.errors import ModelLoadError, ModelNotFoundError
from kvcore.loaders.gguf import load_gguf
from kvcore.loaders.hf import load_hf_dir
from kvcore.loaders.loaded import LoadedModel
from kvcore.loaders.resolve import SMOLLM2_DISPLAY_NAME, smollm2_path
from kvcore.model.config import DEFAULT_MAX_MODEL_LEN
from kvcore.model.decoder import DecoderModel
from kvcore.model.weights import resolve_weights

__all__ = ["load_model", "build_model", "check_finite", "DEFAULT_MODEL"]

#: the spec :func:`load_model` uses when given none
DEFAULT_MODEL = "smollm2"


def load_model(spec: str = DEFAULT_MODEL, *, keep_quantized: bool = False) -> LoadedModel:
    """Load ``spec``: ``"smollm2"``, a path to a ``.gguf`` file, or a Hugging Face model directory.
    ``keep_quantized``: keep a GGUF's Q4_0/Q4_1 layer weights as blocks (for the int4 weight format).

    Raises ModelNotFoundError when ``spec`` names nothing loadable, ModelLoadError when the files are
    broken or describe a model kvcore cannot run.
    """
    spec = str(spec)  # tolerate a pathlib.Path
    return check_finite(_load(spec, keep_quantized))


def check_finite(loaded: LoadedModel) -> LoadedModel:
    """``loaded``, after making sure no weight holds NaN or infinity (a file that does loads and then
    generates garbage, e.g. token 0 over and over). One sum per tensor finds them (NaN and inf propagate);
    only a non-finite sum pays for the element-wise check that names the tensor."""
    for name, weight in loaded.weights.items():
        if not isinstance(weight, torch.Tensor):  # GGUF blocks kept packed (load_model(keep_quantized=True))
            if not weight.is_finite():
                raise ModelLoadError(f"'{loaded.source}': tensor '{name}' holds NaN or infinite values")
        elif not torch.isfinite(weight.sum()) and not bool(torch.isfinite(weight).all()):
            raise ModelLoadError(f"'{loaded.source}': tensor '{name}' holds NaN or infinite values")
    return loaded


def _load(spec: str, keep_quantized: bool) -> LoadedModel:
    if spec.strip().lower() == DEFAULT_MODEL:
        return load_gguf(smollm2_path(), name=SMOLLM2_DISPLAY_NAME, keep_quantized=keep_quantized)

    hint = "give 'smollm2', a .gguf file or a Hugging Face model directory"
    if not spec.strip():
        raise ModelNotFoundError(f"no model given: {hint}")
    path = Path(spec).expanduser()
    if path.is_dir():
        return load_hf_dir(path)
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
            return load_gguf(path, keep_quantized=keep_quantized)
        raise ModelNotFoundError(f"model '{spec}' is neither a .gguf file nor a model directory: {hint}")
    raise ModelNotFoundError(f"model '{spec}' not found: {hint}")


def build_model(
    loaded: LoadedModel,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
    *,
    weights: str = "float",
    group_size: int = 32,
):
    """The decoder of ``loaded``, its RoPE tables sized to ``max_model_len`` (the engine's rule: None means
    the model's window capped at DEFAULT_MAX_MODEL_LEN), on ``device`` in ``dtype``, its matmul
    weights in the ``weights`` format (:mod:`kvcore.kernels.quant`; ``auto`` resolved by
    :func:`kvcore.model.weights.resolve_weights`; ConfigError where it cannot run)."""
    window = loaded.config.max_position_embeddings
    positions = min(max_model_len or min(window, DEFAULT_MAX_MODEL_LEN), window)
    fmt = resolve_weights(weights, dtype, device, loaded.config, loaded.weights)
    model = DecoderModel.from_weights(
        loaded.config, loaded.weights, dtype, max_positions=positions, weight_format=fmt, group_size=group_size
    )
    return model.to(device)


def _has_gguf_magic(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError as exc:
        raise ModelLoadError(f"cannot read '{path}': {exc.strerror or exc}") from None
