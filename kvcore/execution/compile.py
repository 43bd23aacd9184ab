"""Decode steps through ``torch.compile`` (``EngineConfig.compile``, ``kvcore generate --compile``).

A batch-1 decode step of a small model is mostly per-op overhead: some 45 eager ATen calls per layer, each a
few microseconds of dispatch for a few hundred bytes of work. Compiled, the elementwise work between the
matmuls becomes a few generated C++ loops and the whole step one call.

What is compiled: the model's forward over a decode batch (every sequence one new token), with the decode
backend's ``forward`` traced inline, the matmul kernels chosen beforehand (:meth:`DecoderModel.matmuls`).
Prefill and mixed batches run eagerly: their shapes vary with every prompt and their time is in the
matmuls. The LM head, the sampler and the backend-output guard run eagerly too (the guard sees layer 0's
queries and attention output, which the compiled function returns).

Only a backend that declares ``capabilities.compilable`` can be compiled (traceable decode path; see
:class:`~kvcore.interfaces.attention.BackendCapabilities`). The first compile specialises on the shapes it sees; the
first change of the number of keys, then of the batch size, recompiles with that size dynamic, and a
ragged batch (key-padding mask) compiles once more: a handful of compiles per process, not one per step.
They cost tens of seconds each on a cold Inductor cache and much less once torch's on-disk cache holds
them (measured in the README). float32 streams equal the eager ones (tests/e2e/test_fast_decode.py); bfloat16
keeps the eager rounding between ops, but fused reductions sum in another order, so a stream can part from
the eager one at a near-tie. Compiling stays opt-in: the eager float32 path is the reference.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from kvcore.errors import ConfigError, KVCoreError
from kvcore.interfaces.attention import AttentionBackend
from kvcore.kernels.cpu_kernels import cxx_compiler
from kvcore.kernels.quant import Int4Linear, int4_dense, pack_rows
from kvcore.model.embedding import eager_under_compile

__all__ = ["CompiledDecode", "compile_reasons"]


def compile_reasons(backend: AttentionBackend, device: torch.device) -> list[str]:
    """Why decode steps with ``backend`` on ``device`` cannot be compiled ([] = they can)."""
    reasons = []
    if not backend.capabilities.compilable:
        reasons.append(f"backend '{backend.name}' does not declare a torch.compile-traceable decode path "
                       "(capabilities.compilable)")
    if device.type == "cpu" and not cxx_compiler():
        reasons.append("torch.compile on CPU generates C++ and needs a compiler: no g++ or clang++ on PATH "
                       "(or set CXX)")
    return reasons


def _decode_forward(model, backend, cache, plans, layer_groups, input_ids, positions, matmuls):
    """The traced function: hidden states ``[B, d]``, and layer 0's queries and attention output; ``plans``:
    the backend's plan of each group of layers, ``layer_groups`` each layer's group (empty: one group)."""
    layer0 = []

    def attention(layer_idx, q, k, v):
        out = backend.forward(layer_idx, q, k, v, cache, plans[layer_groups[layer_idx]] if layer_groups else plans[0])
        if layer_idx == 0:
            layer0.extend((q, out))
        return out

    hidden = model(input_ids, positions, attention, matmuls)
    return hidden, layer0[0], layer0[1]


#: guards dropped on the model's weights and matmul objects. Dynamo would otherwise check every weight's
#: dtype, shape and strides and the attributes of every object on the way (about 1,500 guards for a 30-layer
#: model, a measurable part of each step) though they never change under an engine. Kept: the types of the
#: matmul objects, the model's config values, and every guard on the inputs, the plan and the cache (whose
#: dtype is the model's), so another model, weight format or batch shape still recompiles.
_WEIGHT_SOURCES = ("model", "matmuls")
_DROPPED = {"TENSOR_MATCH", "NOT_PRESENT_IN_GENERIC_DICT", "DUPLICATE_INPUT"}
#: no size/stride asserts after every extern kernel (hundreds per step); a C++ wrapper instead of a Python
#: one around the kernels; the eager path's bfloat16 rounding between fused ops (streams closer to eager)
_INDUCTOR_OPTIONS = {"size_asserts": False, "cpp_wrapper": True, "emulate_precision_casts": True}


def _guard_filter(entries) -> list[bool]:
    return [not (e.guard_type in _DROPPED and e.name.startswith(_WEIGHT_SOURCES)) for e in entries]


#: prefill forwards of at least this many rows run a model's int4 layer matmuls as bfloat16 GEMMs on weights
#: dequantized per call (torch's int4 kernel is built for few rows: at a 2,048-token prompt oneDNN's
#: bfloat16 GEMM plus the compiled dequantization, a few milliseconds per layer, is the faster pair; below
#: about a thousand rows the dequantization is not repaid)
DENSE_PREFILL_ROWS = 1024


class _DequantizedInt4:
    """``x -> x @ W.T`` for an :class:`~kvcore.kernels.quant.Int4Linear`, ``W`` dequantized by the compiled kernel (the
    int4 kernel itself once compiling has failed)."""

    __slots__ = ("linear", "owner")

    def __init__(self, linear, owner: CompiledDecode) -> None:
        self.linear, self.owner = linear, owner

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lin = self.linear
        if self.owner.failed is None:
            try:
                return F.linear(x, self.owner.dequantize(lin.packed, lin.scales_and_zeros, lin.group_size, pack_rows()))
            except Exception as exc:  # the compile stack, never the values: the int4 kernel computes the same
                self.owner.give_up(exc)
        return lin(x)


class CompiledDecode:
    """Runs decode forwards of one engine's model through ``torch.compile``; long int4 prefills on dense
    weights dequantized by a compiled kernel (:data:`DENSE_PREFILL_ROWS`)."""

    def __init__(self, backend: AttentionBackend, device: torch.device) -> None:
        reasons = compile_reasons(backend, device)
        if reasons:
            raise ConfigError(f"cannot compile decode steps: {'; '.join(reasons)}")
        eager_under_compile()
        options = {"guard_filter_fn": _guard_filter, **_INDUCTOR_OPTIONS}
        self._fn = torch.compile(_decode_forward, dynamic=None, options=options)
        self.dequantize = torch.compile(int4_dense, dynamic=False, options=_INDUCTOR_OPTIONS)
        self._prefill: dict[int, dict | None] = {}  # id(model) -> its dequantizing matmuls (None: not int4)
        #: why compiling failed (then everything runs eagerly, with one warning), else None
        self.failed: str | None = None

    def give_up(self, exc: BaseException) -> None:
        """Compiling failed (a C++ toolchain without Python headers, an Inductor bug...): warn once and run
        eagerly from now on, so that requests go on instead of failing step after step."""
        if self.failed is None:
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            self.failed = f"{type(exc).__name__}: {first}"
            warnings.warn(f"kvcore: torch.compile failed ({self.failed}); this engine runs eagerly from now on",
                          RuntimeWarning, stacklevel=3)

    def prefill_matmuls(self, model, num_rows: int) -> dict | None:
        """For a prefill of ``num_rows`` rows: the model's matmuls with its int4 layer weights dequantized per
        call (None: run the model's own, as for fewer rows or weights the unpacking cannot read)."""
        if num_rows < DENSE_PREFILL_ROWS or getattr(model, "weight_format", "float") != "int4" or self.failed:
            return None
        key = id(model)
        if key not in self._prefill:
            mm = model.matmuls(num_rows)
            layers = {name: fns for name, fns in mm.items() if name != "lm_head"}
            ok = all(isinstance(f, Int4Linear) and f.unpackable for fns in layers.values() for f in fns)
            self._prefill[key] = {name: [_DequantizedInt4(f, self) for f in fns]
                                  for name, fns in layers.items()} if ok else None
        dense = self._prefill[key]
        return None if dense is None else {**model.matmuls(num_rows), **dense}

    def __call__(self, model, backend, cache, plans, layer_groups, input_ids: torch.Tensor, positions: torch.Tensor):
        """``(hidden [B, d], layer 0's q [B, H, D], layer 0's attention output [B, H, D])``, or None when this
        step must run eagerly (compiling failed: see :meth:`give_up`; whatever the failed call wrote to the
        cache, the eager run writes again at the same rows)."""
        if self.failed is not None:
            return None
        try:
            return self._fn(model, backend, cache, plans, layer_groups, input_ids, positions,
                            model.matmuls(input_ids.shape[0]))
        except KVCoreError:
            raise
        except Exception as exc:
            self.give_up(exc)
            return None
