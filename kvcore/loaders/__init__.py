"""Model loading: turn a model spec into a config, float32 weights and a tokenizer.

A spec is ``"smollm2"`` (the embedded default, SmolLM2-135M-Instruct), a ``.gguf`` file, or a
Hugging Face model directory, of any registered architecture (:mod:`kvcore.model.architectures`). Every loader
produces the same :class:`LoadedModel`: weights under kvcore's canonical (Hugging Face ``LlamaForCausalLM``)
parameter names, in Hugging Face's layout, as float32 CPU tensors, so the rest of kvcore never needs to
know where a model came from. :func:`build_model` turns it into a :class:`~kvcore.model.decoder.DecoderModel`.
"""

from kvcore.loaders.load import DEFAULT_MODEL, build_model, check_finite, load_model
from kvcore.loaders.loaded import LoadedModel, check_layer_count, expected_shapes, split_rows, stored_tensors

__all__ = [
    "LoadedModel", "load_model", "build_model", "expected_shapes", "stored_tensors", "split_rows", "check_layer_count",
    "check_finite", "DEFAULT_MODEL",
]
