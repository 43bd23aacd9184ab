"""Weights held in transparent huge pages (Linux), so that streaming them costs no page walks.

At batch 1 a decode step reads every matmul weight once. In 4 KiB pages a small model's weights span tens of
thousands of pages, more than the TLB holds, so every step walks the page tables again for each of them. A
:class:`HugePageArena` is one anonymous region advised ``MADV_HUGEPAGE``, so the kernel backs it with 2 MiB pages
where transparent huge pages are on (``always`` or ``madvise`` in ``/sys/kernel/mm/transparent_hugepage/enabled``):
a few dozen TLB entries cover the weights. The weight formats move their tensors into one
(:meth:`kvcore.kernels.quant.Int4A8Linear.relocate`); elsewhere, or where the advice is refused, the arena is plain
memory and nothing else changes. ``benchmarks/ab/huge_pages.py`` measures what it saves.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

__all__ = ["HUGE_PAGE", "HugePageArena", "Relocatable", "advise_huge_pages", "huge_page_reason", "move_into_huge_pages",
           "plain_pages"]

HUGE_PAGE = 2 << 20  # bytes of a transparent huge page over 4 KiB pages (x86-64, most arm64 kernels)
_ALIGN = 64  # each tensor's first byte: a cache line, as the kernels' vector loads want
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


#: set inside :func:`plain_pages`
_PLAIN_PAGES: ContextVar[bool] = ContextVar("kvcore_plain_pages", default=False)


@contextmanager
def plain_pages() -> Iterator[None]:
    """Arenas made inside (in this thread or task) take plain pages: for weights that are written to a file and then
    used from its mapping, so that nothing streams them from the arena. Where memory is fragmented, a huge page is
    made by compacting memory first, which costs far more than faulting in plain pages."""
    token = _PLAIN_PAGES.set(True)
    try:
        yield
    finally:
        _PLAIN_PAGES.reset(token)


@functools.cache
def huge_page_reason() -> str | None:
    """Why weights cannot be held in transparent huge pages here, or None when they can."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "transparent huge pages are a Linux feature (this Python has no mmap.MADV_HUGEPAGE)"
    try:
        mode = _THP_ENABLED.read_text()
    except OSError:
        return f"this kernel has no transparent huge pages ({_THP_ENABLED} is missing)"
    if "[never]" in mode:
        return f"transparent huge pages are off ({_THP_ENABLED}: never)"
    return None


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class HugePageArena:
    """``nbytes`` bytes of one region, advised into huge pages before anything is written to it (a page is only
    made huge when it is first touched). :meth:`take` copies tensors in, one after the other; a caller replaces its
    tensors by what it returns and lets the originals go, so moving weights in costs no second copy of them all.

    ``huge``: whether the kernel took the advice (False where :func:`huge_page_reason` says why not)."""

    def __init__(self, nbytes: int) -> None:
        # a mapping of its own (not the allocator's heap, whose pages other allocations reuse once freed), in whole
        # huge pages from a huge-page boundary; untouched, none of it is resident yet
        size = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE
        self._map = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # anonymous memory, not shared memory
        self._buffer = torch.frombuffer(self._map, dtype=torch.uint8)  # holds the mapping while a tensor uses it
        self._start = -self._buffer.data_ptr() % HUGE_PAGE
        self._end = self._start + nbytes
        self._used = self._start
        self.huge = huge_page_reason() is None and not _PLAIN_PAGES.get()
        if self.huge:
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE, self._start, size)
            except OSError:  # the kernel refused the advice: plain pages
                self.huge = False

    @property
    def free_bytes(self) -> int:
        return self._end - self._used

    @staticmethod
    def bytes_for(specs: Iterable[tuple[tuple[int, ...], torch.dtype]]) -> int:
        """The ``nbytes`` an arena needs to hold tensors of these ``(shape, dtype)`` (each starts on a cache line)."""
        return sum(_padded(torch.Size(shape).numel() * dtype.itemsize) for shape, dtype in specs)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of the CPU tensor ``t`` in the arena (same dtype, shape and values; contiguous)."""
        if t.device.type != "cpu":
            raise ValueError(f"the arena holds CPU tensors, not one on {t.device}")
        return self.empty(tuple(t.shape), t.dtype).copy_(t)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous ``shape`` tensor of ``dtype`` in the arena (a weight made in place)."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        size = _padded(nbytes)
        if size > self.free_bytes:
            raise ValueError(f"the arena cannot take a {tuple(shape)} {dtype} tensor ({self.free_bytes} bytes free)")
        out = self._buffer[self._used : self._used + nbytes].view(dtype).view(shape)
        self._used += size
        return out


@runtime_checkable
class Relocatable(Protocol):
    """A weight format whose tensors can move (``isinstance(f, Relocatable)``: it has ``relocate``)."""

    def relocate(self, take: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace each of the object's weight tensors ``t`` by ``take(t)`` (a copy elsewhere), one at a time."""


def move_into_huge_pages(
    objects: Sequence[Relocatable], room: Iterable[tuple[tuple[int, ...], torch.dtype]] = ()
) -> HugePageArena | None:
    """Move the weights of ``objects`` into one :class:`HugePageArena` (their tensors' bytes, in order), leaving
    room after them for tensors of the ``(shape, dtype)`` in ``room`` (weights then made in place, with
    :meth:`HugePageArena.empty`); returns it, or None where it would be plain memory (:func:`huge_page_reason`,
    :func:`plain_pages`: the weights then stay where they are)."""
    specs: list[tuple[tuple[int, ...], torch.dtype]] = list(room)
    if huge_page_reason() is not None or _PLAIN_PAGES.get() or not (objects or specs):
        return None

    def measure(t: torch.Tensor) -> torch.Tensor:
        specs.append((tuple(t.shape), t.dtype))
        return t

    for obj in objects:
        obj.relocate(measure)
    arena = HugePageArena(HugePageArena.bytes_for(specs))
    for obj in objects:
        obj.relocate(arena.take)
    return arena


def advise_huge_pages(tensors: Iterable[torch.Tensor]) -> bool:
    """Ask the kernel to back the memory of ``tensors`` (views of one file mapping, such as a prepared model's
    weights: :mod:`kvcore.loaders.model_cache`) with huge pages (``madvise(MADV_HUGEPAGE)`` over the whole 2 MiB
    pages they span). A file mapping cannot be moved into a :class:`HugePageArena` without losing what it shares
    with other processes; where the file system keeps its page cache in large folios (ext4 on Linux 6.16 and
    later, for one), pages read after the advice come in 2 MiB folios mapped as huge pages. Whether the kernel
    took the advice; elsewhere nothing changes. The span is rounded to whole 4 KiB pages, which the mapping holds
    (not to 2 MiB ones, which may reach past it)."""
    spans = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors if t.device.type == "cpu" and t.nbytes]
    if huge_page_reason() is not None or not spans:
        return False
    start = min(a for a, _ in spans) // mmap.PAGESIZE * mmap.PAGESIZE
    end = -(-max(b for _, b in spans) // mmap.PAGESIZE) * mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_HUGEPAGE) == 0
