"""What kvcore runs when a setting is left to it: the one place that turns ``auto`` into a configuration.

``EngineConfig`` leaves ``dtype``, ``weights`` and ``lm_head`` at ``"auto"`` and the backends at ``None``;
:func:`choose_defaults` decides them from the model file and this machine, and says why. The rule: the
fastest configuration whose accuracy is measured and stated (docs/performance.md):

* a GGUF whose layer matmul weights are all Q4_0 / Q4_1 blocks runs them natively: ``int4a8`` weights (kvcore's
  int8-activation kernel, AVX512-VNNI or AVX2) with float32 activations, quantized per group of 32 at each matmul
  as llama.cpp does (bfloat16 activations measurably cost accuracy), the ``int8`` LM head (8-bit codes, exact top
  64) and the ``cpu_decode`` backend where kvcore's C++ kernels can be built; where those kernels cannot run,
  ``int4`` weights on torch's kernel, which takes bfloat16 activations;
* a GGUF whose layer matmul weights are all of the block types kvcore decodes exactly (the K-quant mixes:
  Q4_K, Q5_0, Q5_K, Q6_K, Q8_0, ...) runs them the same way with ``gguf`` weights, where its kernels run;
* anything else (float checkpoints, other GGUF types, non-CPU devices, ``tensor_parallel_size > 1``, which
  shards dense weights only) runs float32 dense weights, the exact reference: a float checkpoint is never
  quantized or rounded silently.

A setting given explicitly is kept as given, and the rest follows from it (``dtype="float32"`` alone gives
the whole reference configuration, dense weights). ``--dtype bfloat16 --lm-head int4`` is the fastest configuration
on quantized files, less accurate (benchmarks/results/accuracy-vs-llamacpp.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kvcore.engine.config import AUTO, EngineConfig, parse_dtype
from kvcore.errors import KVCoreError
from kvcore.interfaces.dtypes import dtype_name
from kvcore.kernels.cpu_kernels import int4a8_reasons, int8_dot_isa, kernel_reasons
from kvcore.kernels.quant import DEFAULT_GROUP_SIZE, QUANTIZED_FORMATS, Int4Linear, quantized_reasons
from kvcore.loaders.gguf_codes import CODE_TYPES
from kvcore.loaders.gguf_validate import validate_gguf
from kvcore.loaders.model_cache import gguf_source
from kvcore.model.embedding import head_rows
from kvcore.plugins.registry import KV_CACHE, PluginRegistry, get_registry

__all__ = ["ModelFacts", "DefaultChoice", "choose_defaults", "file_facts", "model_facts"]

_INT4_GGML_TYPES = (2, 3)  # ggml's Q4_0, Q4_1: exactly kvcore's int4 groups of 32
_CODE_GGML_TYPES = tuple(int(t) for t in CODE_TYPES)  # what the gguf weight format runs as stored
_FAST_BACKEND = "cpu_decode"
_SHARDS_DENSE = "tensor parallelism (tensor_parallel_size > 1) shards dense weights"
#: what the int8-activation kernels' dot products run on (cpu_kernels.int8_dot_isa), for the reasons
_DOT_ISA = {"avx512_vnni": "AVX512-VNNI", "avx2_dot": "AVX2", None: "portable loops"}


@dataclass(frozen=True)
class ModelFacts:
    """What the choice reads about the model. ``native_int4``: every layer matmul weight is a Q4_0/Q4_1 GGUF
    block tensor; ``native_codes``: every one is of a type the ``gguf`` weight format runs. ``dtype`` /
    ``weights``: those of a model already built (an ``Engine(model, ...)``), else None.
    ``heads``: its ``head_dim``, ``num_heads`` and ``num_kv_heads``, when known. ``head_shape``: the LM head's
    ``(vocab, hidden)``, when known."""

    native_int4: bool = False
    native_codes: bool = False
    dtype: str | None = None
    weights: str | None = None
    heads: dict[str, int] | None = None
    head_shape: tuple[int, int] | None = None


@dataclass(frozen=True)
class DefaultChoice:
    """The resolved settings and, for each one kvcore decided, why (settings given are not listed)."""

    dtype: str
    weights: str
    lm_head: str
    backend: str | None  # None: the backends stay as configured (given, or the registry's automatic pick)
    reasons: tuple[str, ...]

    def describe(self) -> str:
        """One line: ``chose dtype bfloat16, weights int4a8, ... because ...``."""
        chosen = [f"dtype {self.dtype}", f"weights {self.weights}", f"lm_head {self.lm_head}"]
        if self.backend:
            chosen.append(f"backend {self.backend}")
        why = "; ".join(self.reasons) or "every setting was given"
        return f"chose {', '.join(chosen)} because {why}"

    def as_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "weights": self.weights, "lm_head": self.lm_head, "backend": self.backend,
                "reasons": list(self.reasons)}

    def apply(self, config: EngineConfig) -> EngineConfig:
        """``config`` (an EngineConfig) with these settings in place of its automatic ones."""
        backend = self.backend if self.backend and not _backend_given(config) else config.backend
        return dataclasses.replace(config, dtype=self.dtype, weights=self.weights, lm_head=self.lm_head,
                                   backend=backend)


def _backend_given(config: EngineConfig) -> bool:
    return any(getattr(config, name) is not None for name in ("backend", "prefill_backend", "decode_backend"))


def choose_defaults(config: EngineConfig, facts: ModelFacts, registry: PluginRegistry | None = None) -> DefaultChoice:
    """Decide every ``auto`` setting of ``config`` for a model with ``facts`` on this machine (the module
    docstring has the rule); settings given stay as given and are checked where the engine uses them."""
    device = torch.device(config.device)
    reasons: list[str] = []
    on_cpu = device.type == "cpu"
    sharded = config.tensor_parallel_size > 1  # tensor parallelism splits dense weights only

    native = _native_format(config, facts, device)  # how auto weights would run the file's own blocks
    dtype = config.dtype
    if dtype == AUTO:
        if facts.dtype is not None:
            dtype = facts.dtype
            reasons.append(f"dtype follows the model's {dtype} weights")
        elif config.weights in ("int4", "int8") or (native == "int4" and not sharded):
            dtype = "bfloat16"
            given = f"{config.weights} weights" if config.weights != AUTO else "the file's Q4_0/Q4_1 blocks"
            reasons.append(f"dtype bfloat16: {given} run on torch's kernels, which take bfloat16 activations")
        elif config.weights in ("int4a8", "gguf") or (native is not None and not sharded):
            dtype = "float32"
            given = f"{config.weights} weights" if config.weights != AUTO else "the file's blocks, run as stored,"
            reasons.append(f"dtype float32: {given} take float32 activations quantized per group of 32 as llama.cpp "
                           "does (bfloat16 activations cost accuracy; --weights float is the exact reference)")
        elif config.lm_head == "int4" and int4a8_reasons():
            dtype = "bfloat16"
            reasons.append("dtype bfloat16: the int4 LM head runs on torch's int4 kernel here, which takes bfloat16 "
                           "activations")
        else:
            dtype = "float32"
            what = ("the device is not a CPU" if not on_cpu else _SHARDS_DENSE if sharded else
                    "the weights are float" if config.weights == "float" else
                    "the file's weights are not all blocks kvcore runs as stored")
            reasons.append(f"dtype float32, the exact reference: {what}")
    torch_dtype = parse_dtype(dtype)

    weights = config.weights
    if weights == AUTO:
        if facts.weights is not None:
            weights = facts.weights
        elif sharded:
            weights = "float"
            if torch_dtype != torch.float32:
                reasons.append(f"weights float: {_SHARDS_DENSE}")
        elif native is not None and (config.dtype == AUTO or torch_dtype == torch.bfloat16) \
                and not quantized_reasons(native, torch_dtype, device):
            weights = native
            isa = _DOT_ISA[int8_dot_isa()]
            reasons.append({"int4a8": f"weights int4a8: the Q4 blocks on kvcore's int8-activation kernel ({isa})",
                            "gguf": f"weights gguf: the file's blocks as stored, on kvcore's int8-activation kernels "
                                    f"({isa})",
                            "int4": "weights int4 (torch's kernel on the Q4 blocks): int4a8 cannot run: "
                                    + "; ".join(int4a8_reasons())}[native])
        else:
            weights = "float"
            if native is not None and torch_dtype == torch.float32:
                reasons.append("weights float: dtype float32 is the exact reference, on dense weights")
            elif facts.native_int4 or facts.native_codes:
                fmt = native or ("int4a8" if facts.native_int4 else "gguf")
                why = quantized_reasons(fmt, torch_dtype, device) or [f"{fmt} weights run with bfloat16 activations"]
                reasons.append(f"weights float: the file's blocks cannot run as stored here: {'; '.join(why)}")
            elif torch_dtype != torch.float32:
                reasons.append("weights float: only a file's own quantized blocks are run quantized unasked")
            elif config.dtype != AUTO:
                reasons.append("weights float: dtype float32 is the exact reference, on dense weights")

    lm_head = config.lm_head
    if lm_head == AUTO:
        lm_head, why = _auto_head(weights, torch_dtype, device, config, facts.head_shape)
        if weights in QUANTIZED_FORMATS:
            reasons.append(f"lm_head {lm_head}: {why}")

    backend = None
    if not _backend_given(config) and weights in QUANTIZED_FORMATS and on_cpu:
        why_not = _fast_backend_reasons(config, facts, torch_dtype, registry, kernel_reasons())
        if why_not:
            reasons.append(f"backend left to the registry: {why_not}")
        else:
            backend = _FAST_BACKEND
            reasons.append("backend cpu_decode: kvcore's split-K decode attention kernel")
    return DefaultChoice(dtype, weights, lm_head, backend, tuple(reasons))


def _native_format(config: EngineConfig, facts: ModelFacts, device: torch.device) -> str | None:
    """The format ``auto`` weights run the file's own GGUF blocks in on ``device``: ``int4a8`` (all Q4_0/Q4_1) or
    ``gguf`` (all of the types it decodes) on kvcore's int8-activation kernels, else ``int4`` on torch's kernel (all
    Q4_0/Q4_1, bfloat16), else None (they do not run as stored here, or the weights are given)."""
    if config.weights != AUTO or not (facts.native_int4 or facts.native_codes):
        return None
    if facts.native_int4:
        return "int4a8" if not _a8_reasons(device) else "int4" if not quantized_reasons("int4", torch.bfloat16,
                                                                                        device) else None
    return "gguf" if not quantized_reasons("gguf", torch.float32, device) else None


def _a8_reasons(device: torch.device) -> list[str]:
    """Why kvcore's int8-activation kernels (int4a8 weights, the int8 head) cannot run on ``device``."""
    return ([] if device.type == "cpu" else [f"kvcore's int8-activation kernels run on CPU only, not {device.type}"]) \
        + int4a8_reasons()


def _auto_head(weights: str, dtype: torch.dtype, device: torch.device, config: EngineConfig,
               head_shape: tuple[int, int] | None) -> tuple[str, str]:
    """The LM head ``auto`` gives with quantized weights, and why: ``int8`` (as accurate as llama.cpp's head on the
    same file: benchmarks/results/accuracy-vs-llamacpp.md) where its kernel runs, else ``int4``, else dense."""
    if weights not in QUANTIZED_FORMATS:
        return "dense", "the weights are dense"
    if config.tensor_parallel_size > 1:
        return "dense", "the packed heads run in one process (tensor_parallel_size > 1)"
    fits = head_shape is None or Int4Linear.fits(*head_shape, DEFAULT_GROUP_SIZE)  # both kernels: V % 16, d % 32
    if not fits:
        return "dense", f"the packed heads' kernels cannot take a [{head_shape[0]}, {head_shape[1]}] head"
    no_int8 = _a8_reasons(device) or quantized_reasons("gguf", dtype, device)
    if not no_int8:
        return "int8", ("the head's 8-bit codes per group of 32 on the int8-activation kernel (the top 64 rescored "
                        "exactly): half the dense head's bytes, as accurate as llama.cpp's head")
    no_int4 = quantized_reasons("int4", dtype, device) + kernel_reasons()
    if not no_int4:
        return "int4", f"int4 scores, the top 64 rescored exactly (the int8 head cannot run: {'; '.join(no_int8)})"
    return "dense", "; ".join(no_int4)


def _fast_backend_reasons(config: EngineConfig, facts: ModelFacts, dtype: torch.dtype, registry: PluginRegistry | None,
                          kernel_why: list[str]) -> str:
    registry = registry or get_registry()
    entry = registry.backends.get(_FAST_BACKEND)
    if entry is None:
        return f"no backend '{_FAST_BACKEND}' is registered"
    why = entry.availability() or "; ".join(kernel_why)
    if why:
        return why
    caps, device = entry.cls.capabilities, torch.device(config.device)
    if device.type not in caps.devices or dtype not in caps.dtypes:
        return f"{_FAST_BACKEND} does not run {dtype_name(dtype)} on {device.type}"
    if config.kv_cache is not None:
        layout = registry.get(config.kv_cache, KV_CACHE).cls.layout
        if layout not in entry.cls.capabilities.kv_layouts:
            return f"the '{config.kv_cache}' KV cache has layout '{layout}', which {_FAST_BACKEND} does not read"
    missing = caps.reasons_variants(config.attention_variants)
    if missing:  # the registry's pick then serves them
        return f"{_FAST_BACKEND} does not serve the selected attention variants ({'; '.join(missing)})"
    if facts.heads is not None:  # a built model: the backend's own check (head sizes, GQA group)
        backend = registry.create(_FAST_BACKEND, config.backend_options.get(_FAST_BACKEND))
        return "; ".join(backend.validate(device=device, dtype=dtype, **facts.heads))
    return ""


def file_facts(spec: str) -> ModelFacts:
    """:class:`ModelFacts` of model ``spec`` from its GGUF header alone (no tensor data read); a directory, a
    missing or unreadable file: no native int4 (the loader then reports what is wrong)."""
    path = gguf_source(spec)
    if path is None:
        return ModelFacts()
    try:
        layout = validate_gguf(path)
    except KVCoreError:
        return ModelFacts()
    layers = [t for t in layout.tensors if t.name.startswith("blk.") and len(t.dims) == 2]
    heads = {t.name: t.dims for t in layout.tensors if t.name in ("output.weight", "token_embd.weight")}
    dims = heads.get("output.weight", heads.get("token_embd.weight"))  # GGUF order: [hidden, vocab]
    return ModelFacts(native_int4=bool(layers) and all(t.ggml_type in _INT4_GGML_TYPES for t in layers),
                      native_codes=bool(layers) and all(t.ggml_type in _CODE_GGML_TYPES for t in layers),
                      head_shape=(dims[1], dims[0]) if dims is not None and len(dims) == 2 else None)


def model_facts(model) -> ModelFacts:
    """:class:`ModelFacts` of a built decoder (its dtype and weight format decide; the file is gone)."""
    mc = model.config
    heads = {"head_dim": mc.head_dim, "num_heads": mc.num_attention_heads, "num_kv_heads": mc.num_key_value_heads}
    return ModelFacts(dtype=dtype_name(model.dtype), weights=getattr(model, "weight_format", "float"),
                      heads=heads, head_shape=tuple(head_rows(model).shape))
