"""What the CPU can do for matmuls: the instruction sets that decide kvcore's weight kernels.

``kvcore bench`` and the benchmarks print :func:`cpu_features` next to their numbers, :mod:`kvcore.kernels.linear`
reads it to pick bfloat16 kernels and :mod:`kvcore.kernels.cpu_kernels` the vector ISA it builds for.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CpuFeatures", "cpu_features"]

#: /proc/cpuinfo flags that matter to the CPU kernels torch ships (oneDNN, the int4/int8 weight-only kernels) and to
#: the ISA kvcore's own kernels are built for (kvcore.kernels.cpu_kernels)
_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512vl", "avx512bw", "avx512_vnni", "avx512_bf16",
          "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile")


@dataclass(frozen=True)
class CpuFeatures:
    """The machine's matmul-relevant ISA, as torch and the kernel sees it."""

    model: str  # e.g. "AMD EPYC 9454 48-Core Processor" ("" when unknown)
    torch_capability: str  # torch.backends.cpu.get_cpu_capability(): "DEFAULT", "AVX2", "AVX512"...
    flags: tuple[str, ...]  # the subset of _FLAGS the CPU reports
    threads: int  # torch's intra-op threads

    @property
    def bf16_matmul(self) -> bool:
        """Native bfloat16 dot products (AVX512_BF16 or AMX): oneDNN's bfloat16 GEMMs then read half the
        bytes of float32 at full speed; without them oneDNN converts to float32 in software, and bfloat16
        weights are no faster than float32 ones."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    @property
    def amx(self) -> bool:
        return "amx_bf16" in self.flags

    def describe(self) -> str:
        """One line: ``AMD EPYC ... | torch AVX512 | avx512_bf16 avx512_vnni ... | 2 threads``."""
        flags = " ".join(self.flags) or "no SIMD flags reported"
        return f"{self.model or platform.machine()} | torch {self.torch_capability} | {flags} | {self.threads} threads"

    def as_dict(self) -> dict:
        return {"model": self.model, "torch_capability": self.torch_capability, "flags": list(self.flags),
                "threads": self.threads, "bf16_matmul": self.bf16_matmul}


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:  # not Linux: torch's capability string is all there is
        return "", frozenset()
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        if model and flags:
            break
    return model, flags


def cpu_features() -> CpuFeatures:
    """The current CPU's features (cpuinfo is read once; the thread count is read on every call)."""
    model, flags = _cpuinfo()
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        capability = "unknown"
    if not flags and capability.startswith("AVX512"):  # no cpuinfo: what torch's dispatch proves
        flags = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512vl", "avx512bw"})
    return CpuFeatures(model, capability, tuple(f for f in _FLAGS if f in flags), torch.get_num_threads())
