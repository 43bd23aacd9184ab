"""A kernel against an earlier version of itself, side by side in one process: what those benchmarks share.

:func:`build` builds one of kvcore's kernel source files as of a git revision (or the working tree) as a standalone
library: the file and the headers beside it as they were then, the flags kvcore's own build uses, the operators
renamed to ``namespace`` so that both versions load at once. :func:`alternate` times the two sides pass by pass.
"""

from __future__ import annotations

import hashlib
import io
import statistics
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from kvcore.kernels.cpu_kernels import _flags, cxx_compiler

ROOT = Path(__file__).resolve().parents[2]
CSRC = "kvcore/kernels/csrc"


def _sources(revision: str | None) -> dict[str, str]:
    """The kernel folder's files by name, at ``revision`` (None: the working tree)."""
    if revision is None:
        return {p.name: p.read_text() for p in (ROOT / CSRC).iterdir() if p.is_file()}
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", revision, CSRC], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        return {Path(m.name).name: archive.extractfile(m).read().decode() for m in archive.getmembers() if m.isfile()}


def build(revision: str | None, source: str, namespace: str) -> None:
    """Build and load ``source`` (a file name in the kernel folder) as of ``revision``, its operators under
    ``namespace`` (``torch.ops.<namespace>``)."""
    files = _sources(revision)
    files[source] = (files[source].replace("TORCH_LIBRARY_FRAGMENT(kvcore,", f"TORCH_LIBRARY_FRAGMENT({namespace},")
                     .replace("TORCH_LIBRARY_IMPL(kvcore,", f"TORCH_LIBRARY_IMPL({namespace},"))
    compiler, compile_flags, link_flags = _flags(cxx_compiler())
    key = hashlib.sha256("\0".join([*(f"{n}\0{t}" for n, t in sorted(files.items())), *compiler, *compile_flags,
                                    torch.__version__]).encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / "kvcore-kernel-ab" / f"{namespace}-{key}"
    library = folder / "kernel.so"
    if not library.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (folder / name).write_text(text)
        subprocess.run([*compiler, *compile_flags, "-I", str(folder), "-shared", str(folder / source), *link_flags,
                        "-o", str(library)], check=True)
    torch.ops.load_library(str(library))


def alternate(sides: dict, passes: int, time_one: Callable[..., float], *args) -> list[float]:
    """The median of ``passes`` timings ``time_one(op, *args)`` of each side's operator, sides alternating (their
    order reversed every other pass) so that a shared machine's load hits both alike; two warm-up passes each first."""
    samples = {name: [] for name in sides}
    for p in range(passes + 2):
        for name in sides if p % 2 == 0 else reversed(sides):
            t = time_one(sides[name], *args)
            if p >= 2:
                samples[name].append(t)
    return [statistics.median(samples[name]) for name in sides]
