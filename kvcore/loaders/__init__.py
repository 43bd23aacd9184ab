"""Model loading: turn a model spec into a config, float32 weights and a tokenizer.

A spec is ``"smollm2"`` (the embedded default, SmolLM2-135M-Instruct), a ``.gguf`` file, or a
Hugging Face model directory, of any registered architecture (:mod:`kvcore.architectures`). Every loader
produces the same :class:`LoadedModel`: weights under kvcore's canonical (Hugging Face ``LlamaForCausalLM``)
parameter names, in Hugging Face's layout, as float32 CPU tensors, so the rest of kvcore never needs to
know where a model came from. :func:`build_model` turns it into a :class:`~kvcore.model.DecoderModel`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcore.errors import ModelLoadError, ModelNotFoundError
from kvcore.model_config import ModelConfig
from kvcore.tokenizer import Tokenizer

__all__ = [
    "LoadedModel", "load_model", "build_model", "expected_shapes", "stored_tensors", "split_rows", "check_layer_count",
    "check_finite", "DEFAULT_MODEL",
]

#: the spec :func:`load_model` uses when given none
DEFAULT_MODEL = "smollm2"


@dataclass
class LoadedModel:
    """A model ready for a backend to run.

    ``weights`` holds kvcore's canonical names (:func:`expected_shapes`: Hugging Face ``LlamaForCausalLM``'s
    plus the optional biases and norms other families have); linear weights are ``[out, in]``:
    ``model.embed_tokens.weight`` [V, d], ``model.layers.{i}.self_attn.q_proj.weight`` [H*d_h, d],
    ``k_proj``/``v_proj`` [H_kv*d_h, d], ``o_proj`` [d, H*d_h], ``mlp.gate_proj``/``up_proj`` [I, d],
    ``down_proj`` [d, I], the norms [d], and ``lm_head.weight`` [V, d] only when the embeddings are not
    tied. Q/K rows follow Hugging Face's rotate-half RoPE convention. Loaded with ``keep_quantized``, a GGUF's
    Q4_0/Q4_1 layer weights are :class:`~kvcore.loaders.gguf_blocks.GGUFBlocks` (same shapes) instead.
    """

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str  # file or directory it was loaded from
    name: str  # short display name


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter a decoder with ``config`` has, by kvcore's canonical (Hugging Face Llama) name, with
    its shape: Llama's, plus Q/K/V biases (``attention_bias``), the output projection's bias
    (``attention_output_bias``), ``self_attn.{q,k}_norm.weight`` [D]
    (``qk_norm``) and, with ``sandwich_norms``, Gemma 2's ``pre_feedforward_layernorm`` /
    ``post_feedforward_layernorm`` (its ``post_attention_layernorm`` then follows attention)."""
    d, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_out = config.num_attention_heads * hd
    kv_out = config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, d)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        for name, rows in (("q", q_out), ("k", kv_out), ("v", kv_out)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (rows, d)
            if config.attention_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = (rows,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "self_attn.o_proj.weight"] = (d, q_out)
        if config.attention_output_bias:
            shapes[p + "self_attn.o_proj.bias"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        if config.sandwich_norms:
            shapes[p + "pre_feedforward_layernorm.weight"] = (d,)
            shapes[p + "post_feedforward_layernorm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, d)
        shapes[p + "mlp.up_proj.weight"] = (inter, d)
        shapes[p + "mlp.down_proj.weight"] = (d, inter)
    shapes["model.norm.weight"] = (d,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    return shapes


def check_layer_count(config: ModelConfig, names: Iterable[str], layer_prefix: str, where: str) -> None:
    """The layers the file's tensor names number (``layer_prefix`` with ``{i}``, e.g. ``blk.{i}.``) must be
    ``0 .. num_hidden_layers - 1``: the config is compared with the file before per-layer tables are built
    from it, so a layer count the file does not back fails with one line naming both.
    """
    head, _, tail = layer_prefix.partition("{i}")
    pattern = re.compile(re.escape(head) + r"(\d{1,9})" + re.escape(tail))
    found = {int(m.group(1)) for m in map(pattern.match, names) if m}
    expected = config.num_hidden_layers
    if found != set(range(expected)):
        extra = sorted(found - set(range(expected)))
        detail = f"layer {extra[0]} is beyond them" if extra else f"only {len(found)} of them have tensors"
        raise ModelLoadError(f"{where}: the config declares {expected} layers but {detail}")


def stored_tensors(
    shapes: dict[str, tuple[int, ...]],
    num_layers: int,
    layer_names: dict[str, tuple[str, ...]],
    layer_prefix: str = "model.layers.{i}.",
    global_names: dict[str, str] | None = None,
) -> dict[str, list[str]]:
    """Tensor names a file stores -> the canonical names each holds (stacked along dim 0).

    :param layer_names: the family's per-layer file names (no ``.weight``/``.bias``) -> canonical names
        (relative to ``model.layers.{i}.``); :meth:`kvcore.architectures.Architecture.layer_names`.
    :param layer_prefix: how the file prefixes layer ``i``'s tensors (``blk.{i}.`` in GGUF).
    :param global_names: canonical -> file name of the tensors outside the layers.
    A canonical tensor nothing covers is stored under its own name.
    """
    stored: dict[str, list[str]] = {}
    covered: set[str] = set()
    for canonical, file_name in (global_names or {}).items():
        if canonical in shapes:
            stored[file_name] = [canonical]
            covered.add(canonical)
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        for file_name, parts in layer_names.items():
            for suffix in (".weight", ".bias"):
                names = [prefix + part + suffix for part in parts]
                if all(n in shapes for n in names):
                    stored[layer_prefix.format(i=i) + file_name + suffix] = names
                    covered.update(names)
    for name in shapes:
        if name not in covered:
            stored[name] = [name]
    return stored


def split_rows(tensor, names: list[str], shapes: dict[str, tuple[int, ...]]) -> dict:
    """A stored (possibly fused) tensor cut along dim 0 into its canonical tensors."""
    if len(names) == 1:
        return {names[0]: tensor}
    parts = tensor.split([shapes[n][0] for n in names], 0)
    return {n: part for n, part in zip(names, parts)}


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
    # loaders are imported here, not at the top, so `import kvcore.loaders` stays light and each
    # loader module can import LoadedModel from this package without a cycle
    if spec.strip().lower() == DEFAULT_MODEL:
        from kvcore.loaders.gguf import load_gguf
        from kvcore.loaders.resolve import SMOLLM2_DISPLAY_NAME, smollm2_path

        return load_gguf(smollm2_path(), name=SMOLLM2_DISPLAY_NAME, keep_quantized=keep_quantized)

    hint = "give 'smollm2', a .gguf file or a Hugging Face model directory"
    if not spec.strip():
        raise ModelNotFoundError(f"no model given: {hint}")
    path = Path(spec).expanduser()
    if path.is_dir():
        from kvcore.loaders.hf import load_hf_dir

        return load_hf_dir(path)
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
            from kvcore.loaders.gguf import load_gguf

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
    the model's window capped at EngineConfig.DEFAULT_MAX_MODEL_LEN), on ``device`` in ``dtype``, its matmul
    weights in the ``weights`` format (:mod:`kvcore.quant`; ``auto`` resolved by
    :func:`kvcore.weights.resolve_weights`; ConfigError where it cannot run)."""
    from kvcore.engine_config import EngineConfig
    from kvcore.model import DecoderModel
    from kvcore.weights import resolve_weights

    window = loaded.config.max_position_embeddings
    positions = min(max_model_len or min(window, EngineConfig.DEFAULT_MAX_MODEL_LEN), window)
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
