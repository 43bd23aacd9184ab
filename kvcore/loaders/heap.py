"""Give the memory a model load frees back to the operating system (glibc's malloc).

Loading makes many large temporaries (a tensor's bytes read from the file, its unpacked codes, a chunk of
dequantized rows), each freed once the packed form exists. glibc serves allocations above a threshold from
their own mappings, but raises that threshold each time such a mapping is freed: from then on temporaries of
that size come from the heap, and what they leave there stays resident after the load (tens of MiB for a
small model). :func:`load_scope` keeps the threshold low while a model loads, then trims the heap and sets the
threshold glibc would have reached by itself, so the steps after the load allocate as fast as before.
Elsewhere (no glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["load_scope", "trim_heap"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
_LOAD_MMAP_THRESHOLD = 128 << 10  # glibc's initial value: every big temporary is its own mapping
_RUN_MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for the dynamic threshold on 64-bit systems


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc only
    except (OSError, AttributeError):
        return None
    return libc


def trim_heap() -> None:
    """Give the heap's free pages back now (inside :func:`load_scope`: between building a model and the next
    step, so what the build left free is not counted again in the next step's peak)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@contextmanager
def load_scope() -> Iterator[None]:
    """While the body runs, freed big temporaries go back to the system at once; afterwards the heap is trimmed."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, _LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        if libc is not None:
            libc.malloc_trim(0)
            libc.mallopt(_M_MMAP_THRESHOLD, _RUN_MMAP_THRESHOLD)
            libc.mallopt(_M_TRIM_THRESHOLD, 2 * _RUN_MMAP_THRESHOLD)  # what glibc pairs with that threshold
