"""Glue the CUDA kernel backends share (flash_attn2, xformers): whether a kernel package can run here, views of
a per-slot cache, the per-step slot plan, and a backend that reaches its kernels through ``self.kernels``."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from kvcore.errors import BackendError, ConfigError
from kvcore.interfaces.attention import AttentionBackend
from kvcore.interfaces.kv_cache import KVCache
from kvcore.interfaces.metadata import AttentionMetadata, cu_seqlens, host_to_device

__all__ = ["cuda_availability", "import_reason", "kv_views", "SlotPlan", "slot_plan", "KernelBackend"]


def cuda_availability(
    module: str, install_hint: str, min_cc: tuple[int, int], extension: str | None = None
) -> str | None:
    """The first reason ``module``'s CUDA kernels cannot run here, or None. Never raises.

    Order: package missing (cheap ``find_spec``, no import) → its compiled ``extension`` module missing →
    no CUDA device → compute capability.
    """
    try:
        if importlib.util.find_spec(module) is None:
            return f"package '{module}' is not installed ({install_hint})"
        if extension is not None and importlib.util.find_spec(extension) is None:
            return (f"'{module}' is there but its CUDA extension '{extension}' is not (a namespace or another "
                    f"major version, e.g. flash-attn-4; {install_hint})")
        if not torch.cuda.is_available():
            return "no CUDA device (torch.cuda.is_available() is False)"
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < min_cc:
            need = f"sm{min_cc[0]}{min_cc[1]}+ required"
            return f"GPU compute capability {major}.{minor} < {min_cc[0]}.{min_cc[1]} ({need})"
    except Exception as exc:  # availability() must never raise
        return f"availability check failed: {type(exc).__name__}: {exc}".splitlines()[0]
    return None


def import_reason(module: str) -> str | None:
    """Import ``module`` (only once CUDA is known to be there); a one-line reason if that fails."""
    try:
        importlib.import_module(module)
    except Exception as exc:
        return f"package '{module}' is installed but failed to import: {type(exc).__name__}: {exc}".splitlines()[0]
    return None


def kv_views(cache: KVCache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of a per-slot cache as ``[num_slots, max_seq_len, H_kv, D]`` views (no copy)."""
    if cache.layout == "flash_contiguous":
        return cache.k[layer_idx], cache.v[layer_idx]
    if cache.layout == "contiguous":
        # [slots, H_kv, S, D] -> [slots, S, H_kv, D]: strided view, last dim still contiguous
        return cache.k[layer_idx].transpose(1, 2), cache.v[layer_idx].transpose(1, 2)
    raise BackendError(f"cannot read a '{cache.layout}' KV cache (reads: flash_contiguous, contiguous)")


@dataclass(frozen=True)
class SlotPlan:
    """What every layer of one call over a per-slot cache shares (flash_attn2, xformers)."""

    meta: AttentionMetadata
    slots_t: torch.Tensor  # [B] int64, cache slot of each sequence
    slots_i32: torch.Tensor  # [B] int32 (flash-attn's cache_batch_idx)
    context_lens_i32: torch.Tensor  # [B] int32, lengths before this call (flash-attn's cache_seqlens)
    gather_slot: torch.Tensor | None  # [sum(seq_lens)] int64: every sequence's full key range, by slot ...
    gather_pos: torch.Tensor | None  # ... and position (a prefill continuing the cache)
    cu_seqlens_k: torch.Tensor | None  # [B + 1] int32, prefix sums of seq_lens


def slot_plan(meta: AttentionMetadata) -> SlotPlan:
    """Built on the host from the metadata's lists and sent in one copy: no device sync, one transfer."""
    slots = torch.tensor(meta.slots, dtype=torch.long)
    host = [slots, slots.to(torch.int32), torch.tensor(meta.context_lens, dtype=torch.int32)]
    if not meta.is_decode and max(meta.context_lens) > 0:
        cu_k = cu_seqlens(meta.seq_lens, "cpu")
        lens = torch.tensor(meta.seq_lens, dtype=torch.long)
        starts = cu_k[:-1].long().repeat_interleave(lens)  # first packed row of each row's sequence
        host += [cu_k, slots.repeat_interleave(lens), torch.arange(int(cu_k[-1])) - starts]
    slots_t, slots_i32, context_lens_i32, *gather = host_to_device(host, meta.positions.device)
    cu_k, gather_slot, gather_pos = gather or (None, None, None)
    return SlotPlan(
        meta=meta,
        slots_t=slots_t,
        slots_i32=slots_i32,
        context_lens_i32=context_lens_i32,
        gather_slot=gather_slot,
        gather_pos=gather_pos,
        cu_seqlens_k=cu_k,
    )


class KernelBackend(AttentionBackend[SlotPlan]):
    """A backend over a per-slot cache that calls its kernels through ``self.kernels``: the real package
    by default (imported on first use), or an object passed as ``kernels=`` (tests pass CPU emulations)."""

    @staticmethod
    def _load_kernels() -> Any:
        raise NotImplementedError

    def __init__(self, kernels: Any = None, **options: Any) -> None:
        super().__init__(**options)
        if isinstance(kernels, str):
            raise ConfigError(f"backend '{self.name}': 'kernels' is a testing hook and cannot be set from a config")
        self._kernels = kernels

    @property
    def kernels(self) -> Any:
        if self._kernels is None:
            self._kernels = self._load_kernels()
        return self._kernels

    def plan(self, meta: AttentionMetadata, cache: KVCache) -> SlotPlan:
        return slot_plan(meta)


