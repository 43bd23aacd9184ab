"""Weights held in transparent huge pages (kvcore/kernels/huge_pages.py): the arena copies exactly, the kernel is told
to back it with huge pages, and a quantized model's kernel weights and int4 head end up in such regions with
unchanged results."""

from __future__ import annotations

import mmap

import pytest
import torch
from helpers import full_attention, make_random_model, weights_of

from kvcore import LlamaModel
from kvcore.kernels.cpu_kernels import int4a8_reasons
from kvcore.kernels.group_quant import GroupCodes, Int8GroupLinear
from kvcore.kernels.huge_pages import (
    HUGE_PAGE,
    HugePageArena,
    advise_huge_pages,
    huge_page_reason,
    move_into_huge_pages,
    plain_pages,
)
from kvcore.kernels.quant import Int4A8Linear
from kvcore.model.lm_head import int4a8_in_chunks

needs_thp = pytest.mark.skipif(huge_page_reason() is not None, reason=huge_page_reason() or "")
needs_kernel = pytest.mark.skipif(bool(int4a8_reasons()), reason="; ".join(int4a8_reasons()))


def _mapping(address: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping holding ``address``: its fields, and ``path`` ('' if anonymous)."""
    found: dict[str, str] | None = None
    for line in open("/proc/self/smaps"):
        head, *rest = line.split(maxsplit=5)
        if "-" in head and ":" not in head:
            if found is not None:
                break
            start, end = (int(x, 16) for x in head.split("-"))
            if start <= address < end:
                found = {"path": rest[4].strip() if len(rest) > 4 else ""}
        elif found is not None:
            key, _, value = line.partition(":")
            found[key] = value.strip()
    assert found is not None, f"no mapping holds {address:#x}"
    return found


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (``hg``: advised MADV_HUGEPAGE)."""
    return _mapping(address)["VmFlags"].split()


def test_the_arena_holds_exact_copies_each_on_a_cache_line():
    ts = [torch.randn(100, 37), torch.arange(11, dtype=torch.int64),
          torch.randint(0, 255, (3, 5000), dtype=torch.uint8), torch.randn(7, 3).to(torch.float16)]
    arena = HugePageArena(HugePageArena.bytes_for((tuple(t.shape), t.dtype) for t in ts))
    out = [arena.take(t) for t in ts]
    for t, o in zip(ts, out):
        assert o.dtype == t.dtype and o.shape == t.shape and o.is_contiguous() and torch.equal(o, t)
        assert o.data_ptr() % 64 == 0
        assert o.untyped_storage().data_ptr() == out[0].untyped_storage().data_ptr()  # one region
    assert out[0].data_ptr() % HUGE_PAGE == 0  # from a huge-page boundary: no other allocation shares its pages
    assert arena.free_bytes == 0
    ts[0].zero_()
    assert not torch.equal(out[0], ts[0])  # a copy, not a view of the original


def test_the_arena_refuses_what_does_not_fit_or_is_not_on_the_cpu():
    arena = HugePageArena(128)
    arena.take(torch.zeros(16, dtype=torch.float32))
    with pytest.raises(ValueError, match="cannot take a \\(32,\\) torch.float32 tensor \\(64 bytes free\\)"):
        arena.take(torch.zeros(32))
    with pytest.raises(ValueError, match="CPU tensors, not one on meta"):
        arena.take(torch.zeros(4, device="meta"))


@needs_thp
def test_the_arena_is_advised_into_huge_pages():
    arena = HugePageArena(3 * HUGE_PAGE)
    t = arena.empty((3 * HUGE_PAGE,), torch.uint8)
    assert arena.huge and "hg" in _vm_flags(t.data_ptr())
    t.fill_(1)  # pages become resident when first written: huge ones (private anonymous memory, not shared memory)
    mapping = _mapping(t.data_ptr())
    assert mapping["path"] == "" and int(mapping["AnonHugePages"].split()[0]) >= HUGE_PAGE // 1024
    plain = mmap.mmap(-1, 3 * HUGE_PAGE)  # a mapping of the same kind, not advised
    assert "hg" not in _vm_flags(torch.frombuffer(plain, dtype=torch.uint8).data_ptr())


@needs_thp
@needs_kernel
def test_a_quantized_model_holds_its_kernel_weights_in_one_huge_page_region_with_the_same_results():
    base = make_random_model(num_layers=2)
    model = LlamaModel.from_weights(base.config, weights_of(base), torch.bfloat16, weight_format="int4a8")
    fns = [f for fs in model._quantized.values() for f in fs]
    assert fns and all(isinstance(f, Int4A8Linear) for f in fns)
    tensors = [t for f in fns for t in (f.codes, f.dm)]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert "hg" in _vm_flags(tensors[0].data_ptr())
    ids, pos = torch.tensor([5, 9, 200, 31, 7]), torch.arange(5)
    logits = model.compute_logits(model(ids, pos, full_attention))
    for f in fns:  # back into plain allocations of their own: the kernels read the same values
        f.relocate(lambda t: t.clone())
    assert torch.equal(model.compute_logits(model(ids, pos, full_attention)), logits)


@needs_thp
@needs_kernel
def test_arenas_made_under_plain_pages_are_plain_and_nothing_moves_into_them():
    """Weights made to be written to a file take plain pages (no compaction for huge ones); the setting ends with
    its block."""
    w = (torch.randn(1024, 64, generator=torch.Generator().manual_seed(1)) * 0.1).to(torch.bfloat16)
    with plain_pages():
        arena = HugePageArena(1 << 20)
        head = int4a8_in_chunks(w, rows=512)
        assert move_into_huge_pages([head]) is None
    assert not arena.huge and "hg" not in _vm_flags(arena.empty((64,), torch.uint8).data_ptr())
    assert "hg" not in _vm_flags(head.codes.data_ptr())
    assert HugePageArena(1 << 20).huge


@needs_thp
@needs_kernel
def test_the_int4_head_is_made_in_huge_pages_and_moving_weights_twice_keeps_them():
    w = (torch.randn(2048, 64, generator=torch.Generator().manual_seed(0)) * 0.1).to(torch.bfloat16)
    head = int4a8_in_chunks(w, rows=512)
    assert "hg" in _vm_flags(head.codes.data_ptr()) and "hg" in _vm_flags(head.dm.data_ptr())
    x = torch.randn(3, 64).to(torch.bfloat16)
    before = head(x)
    arena = move_into_huge_pages([head])
    assert arena is not None and arena.huge and arena.free_bytes == 0
    assert torch.equal(head(x), before)


@needs_thp
@needs_kernel
def test_the_8_bit_group_kernel_reads_the_same_weights_from_huge_pages():
    g = torch.Generator().manual_seed(1)
    n, k = 64, 128
    q = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    codes = GroupCodes(q, torch.rand(n, k // 32, generator=g) / 256, torch.randn(n, k // 32, generator=g) / 8, 8)
    lin = Int8GroupLinear(codes)
    x = torch.randn(5, k, generator=g).to(torch.bfloat16)
    before = lin(x)
    assert move_into_huge_pages([lin]) is not None
    assert "hg" in _vm_flags(lin.packed.data_ptr())
    assert lin.packed.untyped_storage().data_ptr() == lin.dm.untyped_storage().data_ptr()
    assert torch.equal(lin(x), before)


@needs_thp
def test_a_mapped_file_is_advised_into_huge_pages(tmp_path):
    """A prepared model's weights are views of a file mapping (torch.load(mmap=True)): advised MADV_HUGEPAGE, the
    mapping's other pages and the values untouched."""
    torch.save({"a": torch.arange(3 * HUGE_PAGE // 4, dtype=torch.int32), "b": torch.ones(5)}, tmp_path / "w.pt")
    tensors = torch.load(tmp_path / "w.pt", mmap=True, weights_only=True)
    assert "hg" not in _vm_flags(tensors["a"].data_ptr()) and _mapping(tensors["a"].data_ptr())["path"].endswith("w.pt")
    assert advise_huge_pages(tensors.values())
    assert "hg" in _vm_flags(tensors["a"].data_ptr()) and "hg" in _vm_flags(tensors["b"].data_ptr())
    assert torch.equal(tensors["a"], torch.arange(3 * HUGE_PAGE // 4, dtype=torch.int32))
    assert not advise_huge_pages([])
