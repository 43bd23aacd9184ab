"""Helpers every ``kvcore bench`` mode shares: the prompt text, the machine and load it ran on, the kernels
kvcore ran, ``--engine-option`` parsing and the optional plot backend.

Nothing here imports another kvcore_bench module: the harness (:mod:`kvcore_bench.bench`), the llama.cpp
comparisons (:mod:`kvcore_bench.vs_llamacpp`, :mod:`kvcore_bench.vs_native`) and the scale curves
(:mod:`kvcore_bench.scale`) all import it, never each other's internals.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from typing import Any

__all__ = ["TEXT", "cpu_features", "describe_kernels", "engine_options", "environment", "load_average",
           "machine_line", "median", "pyplot"]

#: natural text every mode builds its prompts from (repeated to length)
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press into a system that could reproduce pages "
    "quickly and cheaply. Within a few decades presses operated in more than two hundred European cities, "
    "and the number of books in circulation grew from thousands to millions. Scholars could compare "
    "identical copies of a text, merchants printed price lists and contracts, and pamphlets carried news "
    "and arguments faster than any messenger. "
)


def median(values):
    """The median of the values that are not None, or None when there are none."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def load_average() -> str | None:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
        flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
        isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
        return f"{name or platform.processor()} × {os.cpu_count()} ({', '.join(isa) or 'no AVX2'})"
    except OSError:
        return f"{platform.processor()} × {os.cpu_count()}"


def machine_line(env: dict[str, Any]) -> str:
    """The reports' line naming the CPU, its vector extensions and torch's kernels (``env``: :func:`environment`)."""
    isa = ", ".join(k for k, v in env["isa"].items() if v) or "none of AVX2/AVX-512/AMX"
    return f"- CPU: {env['cpu']}; ISA: {isa}; torch CPU capability: {env['torch_cpu_capability']}"


def environment() -> dict[str, Any]:
    import torch

    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    return {
        "command": "kvcore " + " ".join(sys.argv[1:]) if "bench" in sys.argv[1:] else None,
        "torch": torch.__version__,
        "transformers": tf_version,
        "threads": torch.get_num_threads(),
        "cpu": _cpu_name(),
        "python": platform.python_version(),
        "load_average": load_average(),
    }


def cpu_features() -> dict[str, Any]:
    """CPU model, the ISA extensions that matter for these kernels, and torch's dispatch level."""
    import torch

    name, flags = "?", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and name == "?":
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    isa = {f: f in flags for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")}
    return {"cpu": name, "isa": isa, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def engine_options(pairs: list[str]) -> dict[str, Any]:
    """``--engine-option KEY=VALUE`` pairs as EngineConfig keyword arguments (VALUE as JSON, else a string)."""
    from kvcore.errors import ConfigError

    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--engine-option wants KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value  # a bare string
    return options


def describe_kernels(engine) -> str:
    """What kvcore ran: the attention backends and the matmul path of the model."""
    import torch

    from kvcore.kernels.cpu import cpu_features

    model = engine.model
    describe = getattr(model, "describe_kernels", None)  # a model that knows its kernels says so
    fmt = getattr(model, "weight_format", "float")
    if callable(describe):
        matmul = describe()
    elif fmt == "int4":
        matmul = "int4 group-wise weight-only (_weight_int4pack_mm_for_cpu, bfloat16 activations)"
    elif fmt == "int4a8":
        from kvcore.kernels.cpu_kernels import int8_dot_isa

        matmul = f"int4 group-wise, kvcore int4_linear (int8 activations per group of 32, {int8_dot_isa()})"
    elif fmt == "int8":
        matmul = "int8 per-channel weight-only (_weight_int8pack_mm, bfloat16 activations)"
    elif model.dtype == torch.bfloat16 and model.device.type == "cpu" and cpu_features().bf16_matmul:
        matmul = "bfloat16 oneDNN-prepacked GEMM"
    elif model.dtype == torch.float32 and model.device.type == "cpu":
        packed = getattr(model, "packed_weights", False)
        multi_row = "oneDNN-prepacked GEMM" if packed else "MKL GEMM"
        matmul = f"float32 split GEMV (1 row), {multi_row} (2+ rows)"
    else:
        matmul = f"{str(model.dtype).removeprefix('torch.')} F.linear"
    head = getattr(engine, "lm_head", None)
    if hasattr(head, "linear"):  # the int8 head
        matmul += "; LM head int8 (kvcore int8_group_linear), top 64 rescored dense"
    elif head is not None:
        scores = "kvcore int4_linear" if getattr(head.int4, "format", "") == "int4a8" else "_weight_int4pack_mm_for_cpu"
        matmul += f"; LM head int4 ({scores}), top 64 rescored dense"
    compiled = getattr(engine, "compiled_decode", None) is not None
    compiled = "; decode steps torch.compile'd (inductor, C++ wrapper)" if compiled else ""
    decode = engine.decode_backend.name
    prefill = engine.prefill_backend.name
    if decode == "cpu_decode":
        from kvcore.kernels.cpu_kernels import vector_isa

        decode += f" (kvcore C++ kernel, {vector_isa()})"
    if prefill == "cpu_decode" and model.dtype == torch.bfloat16 and torch.ops.kvcore.built_with("avx512_bf16"):
        prefill += " (kvcore C++ kernel, AVX512_BF16)"
    return (f"attention prefill={prefill} decode={decode}, "
            f"KV cache {engine.cache.name}; matmuls {matmul}{compiled}")


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
