"""Per-step host syncs and host-to-device copies on the attention path, counted on the CPU.

On CUDA every ``.tolist()`` / ``int(t)`` / ``.item()`` of a device tensor stalls the host until the GPU has
caught up, and every small pageable host-to-device copy is a synchronous transfer. The metadata path
(``KVCacheManager.prepare`` → ``backend.plan`` → every layer's ``forward``) must do its host work once per
step, send it in one copy per stage, and run the layers without touching the host.

These tests run that path with every tensor on PyTorch's ``meta`` device (shapes, no data): a host sync
of a device tensor cannot happen there, a copy from the host to it is an explicit call, and a
``TorchFunctionMode`` records both. The kernels of the CUDA-only backends are test doubles that return
outputs of the right shape; the bias classes are the emulated ones, counted when built.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kernel_emulation import (
    EmulatedBlockDiagonalCausalMask,
    EmulatedBlockDiagonalCausalWithOffsetGappyKeysMask,
    EmulatedBlockDiagonalCausalWithOffsetPaddedKeysMask,
)
from torch.overrides import TorchFunctionMode

import kvcore.interfaces.metadata as metadata_mod  # where AttentionMetadata.build sends its tensors
from kvcore.backends.flash_attn2 import FlashAttn2Backend
from kvcore.backends.naive import NaiveBackend
from kvcore.backends.paged import PagedBackend
from kvcore.backends.sdpa import SDPABackend
from kvcore.backends.xformers import XFormersBackend
from kvcore.interfaces.kv_cache import CacheSpec
from kvcore.interfaces.metadata import AttentionMetadata, host_to_device
from kvcore.plugins.registry import get_registry
from kvcore.scheduling.kv_manager import KVCacheManager

DEVICE = torch.device("meta")
LAYERS = 3
SYNCS = {"tolist", "item", "__int__", "__bool__", "__float__", "__index__", "numpy"}
COPIES = {"to", "copy_", "tensor", "as_tensor", "cuda"}


class Transfers(TorchFunctionMode):
    """Records host syncs of device tensors and copies from the host onto the device."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self.copies: list[tuple[str, bool]] = []  # (function, non_blocking)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in SYNCS and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
            self.syncs.append(name)
            raise AssertionError(f"host sync: Tensor.{name}() of a {args[0].device.type} tensor")
        out = func(*args, **kwargs)
        if name in COPIES and isinstance(out, torch.Tensor) and out.device.type != "cpu":
            src = args[1] if name == "copy_" else (args[0] if args else None)
            if not isinstance(src, torch.Tensor) or src.device.type == "cpu":
                self.copies.append((name, bool(kwargs.get("non_blocking", False))))
        return out


def _xformers_doubles(built: list[str]):
    def counted(cls):
        class Counted(cls):
            @classmethod
            def from_seqlens(cls, *args, **kwargs):
                built.append(cls.__name__)
                return super().from_seqlens(*args, **kwargs)

        return Counted

    return SimpleNamespace(
        memory_efficient_attention=lambda q, k, v, **kw: torch.empty(q.shape, dtype=q.dtype, device=q.device),
        BlockDiagonalCausalMask=counted(EmulatedBlockDiagonalCausalMask),
        BlockDiagonalCausalWithOffsetPaddedKeysMask=counted(EmulatedBlockDiagonalCausalWithOffsetPaddedKeysMask),
        BlockDiagonalCausalWithOffsetGappyKeysMask=counted(EmulatedBlockDiagonalCausalWithOffsetGappyKeysMask),
    )


FLASH_DOUBLES = SimpleNamespace(
    flash_attn_varlen_func=lambda q, *a, **kw: torch.empty_like(q),
    flash_attn_with_kvcache=lambda q, *a, **kw: torch.empty_like(q),
)

# (backend, cache kind) pairs the engine runs on CUDA
CASES = {
    "naive": (NaiveBackend, "contiguous"),
    "sdpa": (SDPABackend, "contiguous"),
    "paged": (PagedBackend, "paged"),
    "paged+int8": (PagedBackend, "int8"),
    "flash_attn2": (lambda: FlashAttn2Backend(kernels=FLASH_DOUBLES), "flash_contiguous"),
    "flash_attn2+contiguous": (lambda: FlashAttn2Backend(kernels=FLASH_DOUBLES), "contiguous"),
    "xformers": ("xformers", "flash_contiguous"),
    "xformers+contiguous": ("xformers", "contiguous"),
    "xformers-fp32": ("xformers", "flash_contiguous"),
}
# fresh ragged prefill, continuing prefill, decode in permuted slot order, decode on consecutive slots
STEPS = [([0, 1, 2], [5, 1, 17]), ([0, 2], [4, 6]), ([2, 0, 1], [1, 1, 1]), ([0, 1, 2], [1, 1, 1])]


def _run_steps(case: str):
    """Every step's (copies in prepare, copies in plan, copies in the layers) and the biases built."""
    make, kind = CASES[case]
    built: list[str] = []
    backend = XFormersBackend(kernels=_xformers_doubles(built)) if make == "xformers" else make()
    dtype = torch.float32 if case.endswith("fp32") else torch.float16  # fp16/bf16 and fp32 take different biases
    spec = CacheSpec(LAYERS, 2, 64, dtype, DEVICE, 4, 64, block_size=16)
    kv = KVCacheManager(get_registry().kv_caches[kind].cls(spec))  # by class: the registry refuses "meta"
    for s in range(3):
        kv.add_sequence(s)
    counts = []
    for seq_ids, query_lens in STEPS:
        tokens = sum(query_lens)
        q = torch.empty(tokens, 8, 64, dtype=dtype, device=DEVICE)
        k = torch.empty(tokens, 2, 64, dtype=dtype, device=DEVICE)
        per_stage = []
        with Transfers() as t:
            meta = kv.prepare(seq_ids, query_lens, 0.125)
            per_stage.append(list(t.copies))
            t.copies.clear()
            plan = backend.plan(meta, kv.cache)
            per_stage.append(list(t.copies))
            t.copies.clear()
            for layer in range(LAYERS):
                backend.forward(layer, q, k, k, kv.cache, plan)
            per_stage.append(list(t.copies))
        counts.append(per_stage)
    return counts, built


@pytest.mark.parametrize("case", list(CASES))
def test_metadata_path_has_no_host_sync_and_one_copy_per_stage(case):
    counts, built = _run_steps(case)
    for (seq_ids, query_lens), (prepare, plan, layers) in zip(STEPS, counts):
        where = f"{case}, step {seq_ids} {query_lens}"
        assert len(prepare) == 1, f"{where}: the metadata took {len(prepare)} host-to-device copies"
        assert len(plan) <= 1, f"{where}: plan() took {len(plan)} host-to-device copies"
        assert not layers, f"{where}: {len(layers)} host-to-device copies in {LAYERS} layers ({layers})"
        assert all(non_blocking for _, non_blocking in prepare + plan), f"{where}: a blocking copy"
    if case.startswith("xformers"):  # one attention bias per step, never one per layer
        assert len(built) == len(STEPS)


def test_planted_per_layer_sync_is_caught(monkeypatch):
    """A backend reading ``cu_seqlens_q.tolist()`` in its layers (what naive/sdpa did) fails the count."""
    monkeypatch.setattr(AttentionMetadata, "query_starts", property(lambda self: self.cu_seqlens_q.tolist()))
    with pytest.raises(AssertionError, match=r"host sync: Tensor.tolist\(\) of a meta tensor"):
        _run_steps("naive")


def test_planted_per_tensor_copies_are_caught(monkeypatch):
    """Metadata sent one tensor at a time (what AttentionMetadata.build did) fails the count."""
    monkeypatch.setattr(metadata_mod, "host_to_device", lambda tensors, device: [t.to(device) for t in tensors])
    with pytest.raises(AssertionError, match="the metadata took 5 host-to-device copies"):
        test_metadata_path_has_no_host_sync_and_one_copy_per_stage("sdpa")


class _FakeCuda(TorchFunctionMode):
    """Stands in for CUDA on a CPU build: records pinned allocations; a copy "to cuda" lands on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned = 0
        self.copies: list[dict] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.empty and kwargs.pop("pin_memory", False):
            self.pinned += 1
        target = args[1] if len(args) > 1 else kwargs.get("device")
        if getattr(func, "__name__", "") == "to" and isinstance(target, str | torch.device) and "cuda" in str(target):
            self.copies.append(kwargs)
            return torch.empty(args[0].shape, dtype=args[0].dtype, device="meta")
        return func(*args, **kwargs)


def test_host_to_device_stages_through_one_pinned_buffer():
    host = [torch.arange(5), torch.tensor([0, 3, 5], dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32)]
    with _FakeCuda() as fake:
        out = host_to_device(host, "cuda")
    assert fake.pinned == 1 and fake.copies == [{"non_blocking": True}]
    assert [(t.shape, t.dtype) for t in out] == [(h.shape, h.dtype) for h in host]
    assert host_to_device(host, "cpu") == host  # nothing to move
    values = host_to_device(host, "meta")
    assert [(t.shape, t.dtype, t.device.type) for t in values] == [(h.shape, h.dtype, "meta") for h in host]
