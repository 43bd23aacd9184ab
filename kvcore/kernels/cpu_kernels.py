"""kvcore's own CPU kernels (C++ under ``kvcore/csrc``), built on first use with the machine's compiler.

The kernels:

* ``torch.ops.kvcore.decode_attention`` (``csrc/decode_attention.cpp``): ``cpu_decode``'s decode-step attention, and
  ``cached_decode_attention`` beside it: the cache write and that attention in one call per layer;
* ``torch.ops.kvcore.prefill_attention`` (``csrc/prefill_attention.cpp``): its bfloat16 prefill attention, built
  only for CPUs with AVX512_BF16;
* ``torch.ops.kvcore.int4_linear`` (``csrc/int4_linear.cpp``): every matmul of the ``int4a8`` weight format
  (:class:`kvcore.kernels.quant.Int4A8Linear`), decode steps and prefills;
* ``torch.ops.kvcore.int8_group_linear`` (``csrc/int8_group_linear.cpp``): the same with 8-bit codes in groups of
  16 or 32 (:class:`kvcore.kernels.group_quant.Int8GroupLinear`: a GGUF's 5-, 6- and 8-bit blocks as stored);
* ``torch.ops.kvcore.bf16_linear`` (``csrc/bf16_linear.cpp``): dense bfloat16 matmuls of up to 128 rows (decode
  steps, short prefills) on weights repacked for ``vdpbf16ps`` (:mod:`kvcore.kernels.linear`), built only for CPUs with
  AVX512_BF16;
* ``torch.ops.kvcore.rescore_top_k`` (``csrc/rescore_top_k.cpp``): the int4 LM head's exact rescoring of each
  row's top candidates (:class:`kvcore.model.lm_head.RescoredInt4Head`), run eagerly, and its ``_float`` forms that
  return those logits widened to float32;
* ``torch.ops.kvcore.all_finite`` and ``torch.ops.kvcore.argmax_rows`` (``csrc/logits.cpp``): the backend check's
  finiteness flag and greedy decoding's argmax, one operator each instead of several ATen ops;
* ``torch.ops.kvcore.q8_0_rows`` (``csrc/q8_0_rows.cpp``): a Q8_0 token table's rows decoded in one call;
* ``torch.ops.kvcore.q4_blocks_to_int4a8`` and ``torch.ops.kvcore.int4a8_quantize`` (``csrc/int4a8_pack.cpp``):
  ``int4a8`` weights made in one pass, as a model file is first prepared: a GGUF file's Q4_0 / Q4_1 blocks
  rewritten in the kernel's layout, and float rows (the int4 LM head's) quantized and packed;
* ``torch.ops.kvcore.rms_norm`` (``csrc/rms_norm.cpp``): a bfloat16 residual add and RMSNorm in one operator, for
  the decoder of an ``int4a8`` model (:func:`kvcore.model.layers.add_rms_norm`);
* ``torch.ops.kvcore.fused_qkv`` and ``torch.ops.kvcore.fused_mlp`` (``csrc/fused_layer.cpp``): a bfloat16 ``int4a8``
  decoder layer as two operators around its attention call (:mod:`kvcore.model.fused_layer`), and
  ``torch.ops.kvcore.decode_stack`` (``csrc/decode_stack.cpp``): the same layers, with the decode kernel's cache
  write and attention between them, for every layer of a decode call after the first, in one call.

``torch.ops.kvcore.built_with("avx512_vnni" | "avx2_dot" | "avx512_bf16")`` (``csrc/isa.cpp``) says whether the
library was compiled with an extension (``csrc/isa.h`` decides it for every kernel file): :func:`extension_reasons`
and :func:`int8_dot_isa` say whether it will be.

They are ordinary torch operators (with fake implementations for ``torch.compile``: :mod:`kvcore.kernels.cpu_fakes`), so
compiled decode steps call them directly.

Build: one ``c++`` call (``$CXX``, split as a shell would, so ``ccache g++`` works; else ``g++``, else ``clang++``)
against torch's headers and libraries, with the widest vector ISA this CPU and ATen's ``Vectorized`` both support
(:func:`vector_isa`: AVX-512, else AVX2, else portable code), once; the first build says so on stderr (``kvcore
kernels build`` does it ahead). The library is cached under ``$KVCORE_CACHE_DIR/kernels`` (else
``$XDG_CACHE_HOME/kvcore/kernels``, else ``~/.cache/kvcore/kernels``) keyed by the sources, the flags, the compiler
and torch's version (not by where they lie), so an upgrade or another CPU builds afresh. The folder must be the
user's own (:mod:`kvcore.paths`: a library in a folder others can write is never loaded), the library's checksum is
verified before it is loaded (a damaged one is rebuilt), and a cache that cannot be written means a build into a
private temporary folder, with a warning. A failed build is a :class:`~kvcore.errors.KernelBuildError` with the
compiler's first error line.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kvcore.errors import BackendUnavailableError, KernelBuildError
from kvcore.kernels.cpu import cpu_features
from kvcore.kernels.cpu_fakes import register_fakes
from kvcore.paths import cache_root, private_dir, verify_entry, warn_no_cache, write_entry

__all__ = ["bf16_linear_ready", "cxx_compiler", "extension_reasons", "int4a8_reasons", "int8_dot_isa",
           "kernel_reasons", "kernels_built", "kernels_loaded", "load_kernels", "vector_isa"]

_SOURCES = ("bf16_linear.cpp", "decode_attention.cpp", "decode_stack.cpp", "fused_layer.cpp", "int4_linear.cpp",
            "int4a8_pack.cpp", "int8_group_linear.cpp", "isa.cpp", "logits.cpp", "prefill_attention.cpp",
            "q8_0_rows.cpp", "rescore_top_k.cpp", "rms_norm.cpp")
# included by the sources: in the cache key
_HEADERS = ("decode_attention.h", "fused_layer.h", "group_matmul.h", "int4a8.h", "isa.h", "quantize_rows.h",
            "rms_norm.h")
_CSRC = Path(__file__).with_name("csrc")
_LIBRARY = "kvcore_cpu_kernels.so"
#: what a cache entry of the kernels holds (the library and its checksum); part of the key, so folders of
#: an older layout are never read (they are not kvcore entries either, and are left alone)
_ENTRY_FORMAT = "2"
#: what to do about a compiler that fails
_COMPILER_FIX = "CXX must name a C++20 compiler (g++ >= 10 or clang++ >= 12), e.g. CXX=g++ or CXX='ccache g++'"
#: ISA -> (ATen's CPU_CAPABILITY macro, compiler flags), widest first; the CPU must report every flag in the set
_ISAS = {
    "avx512": ("CPU_CAPABILITY_AVX512", ("-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-mf16c"),
               {"avx512f", "avx512dq", "avx512vl", "avx512bw", "fma", "f16c"}),
    "avx2": ("CPU_CAPABILITY_AVX2", ("-mavx2", "-mfma", "-mf16c"), {"avx2", "fma", "f16c"}),
}


def cxx_compiler() -> str | None:
    """The C++ compiler torch.compile and kvcore's kernels use: ``$CXX``, else ``g++``, else ``clang++``."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def vector_isa() -> str:
    """``"avx512"``, ``"avx2"`` or ``"portable"``: what the kernels are built for on this CPU."""
    flags = set(cpu_features().flags)
    for name, (_, _, needs) in _ISAS.items():
        if needs <= flags:
            return name
    return "portable"


def kernel_reasons() -> list[str]:
    """Why kvcore's CPU kernels cannot be built here ([] = they can be; building may still fail)."""
    reasons = []
    missing = [name for name in (*_SOURCES, *_HEADERS) if not (_CSRC / name).is_file()]
    if missing:
        reasons.append(f"this kvcore install lacks its kernel sources ({', '.join(missing)} under {_CSRC}); "
                       "reinstall kvcore")
    cxx = cxx_compiler()
    if not cxx:
        reasons.append("kvcore's CPU kernels are C++ built on first use: no g++ or clang++ on PATH (or set CXX)")
    elif not shlex.split(cxx) or not shutil.which(shlex.split(cxx)[0]):
        reasons.append(f"kvcore's CPU kernels are C++ built on first use: CXX={cxx!r} names no program on PATH; "
                       "install g++ or set CXX to a C++ compiler")
    if not (Path(torch.__file__).parent / "include" / "ATen" / "ATen.h").is_file():
        reasons.append("this torch install has no C++ headers (torch/include) to build kvcore's CPU kernels")
    return reasons


def _flags(cxx: str) -> tuple[list[str], list[str], list[str]]:
    """The compiler command, the compile flags and the link flags of the kernels."""
    torch_dir = Path(torch.__file__).parent
    isa = vector_isa()
    macro, isa_flags, _ = _ISAS.get(isa, ("", (), set()))
    # extensions some kernels use where the CPU has them (csrc/isa.h)
    isa_flags += ("-mavx512vnni",) * (not extension_reasons("avx512_vnni"))  # int4 x int8 dot products
    isa_flags += ("-mavx512bf16",) * (not extension_reasons("avx512_bf16"))  # bfloat16 pair products
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -fopenmp: at::parallel_for is inline OpenMP code compiled here (without it, one thread); the library then
    # needs libgomp.so.1, which resolves to the copy torch has already loaded, with torch's thread count
    compile_flags = ["-O3", "-std=c++20", "-fPIC", "-fopenmp", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                     *([f"-D{macro}"] if macro else []), *isa_flags, "-isystem", str(torch_dir / "include")]
    return shlex.split(cxx), compile_flags, ["-fopenmp", f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu"]


def _command(cxx: str, sources: list[Path], out: Path) -> list[str]:
    """The build as one command (what the cache key hashes); :func:`_build` runs the same flags as one
    compile per source, in parallel, and a link."""
    compiler, compile_flags, link_flags = _flags(cxx)
    return [*compiler, *compile_flags, "-shared", *map(str, sources), *link_flags, "-o", str(out)]


def _compile_all(commands: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Run the per-source compiles, as many at a time as this process may use cores."""
    workers = max(1, min(len(commands), len(os.sched_getaffinity(0))))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), commands))


def _first_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()] or lines
    return (errors or ["no output"])[0][:300]


def _build(cxx: str, sources: list[Path], folder: Path) -> Path:
    """Compile the kernels into ``folder``; raises :class:`KernelBuildError` with the compiler's first error."""
    library = folder / _LIBRARY
    compiler, compile_flags, link_flags = _flags(cxx)
    objects = [folder / f"{i}-{src.stem}.o" for i, src in enumerate(sources)]
    compiles = [[*compiler, *compile_flags, "-c", str(src), "-o", str(obj)] for src, obj in zip(sources, objects)]
    link = [*compiler, "-shared", *map(str, objects), *link_flags, "-o", str(library)]
    try:
        done = [*_compile_all(compiles)]
        if all(step.returncode == 0 for step in done):
            done.append(subprocess.run(link, capture_output=True, text=True))
    except OSError as exc:  # the compiler is not there or cannot run
        raise KernelBuildError(f"building kvcore's CPU kernels failed ({cxx}): cannot run the compiler: "
                               f"{exc.strerror or exc}; {_COMPILER_FIX}") from None
    failed = next((step for step in done if step.returncode != 0), None)
    if failed is not None or not library.is_file():
        stderr = failed.stderr if failed is not None else ""
        raise KernelBuildError(f"building kvcore's CPU kernels failed ({cxx}): {_first_error(stderr)}; "
                               f"{_COMPILER_FIX}")
    return library


def _load(library: Path, entry: Path | None) -> None:
    try:
        torch.ops.load_library(str(library))
    except OSError as exc:
        where = f"; delete {entry} to rebuild it" if entry is not None else ""
        raise KernelBuildError(f"loading kvcore's CPU kernels from {library} failed: {exc}{where}") from None


def _entry_name(cxx: str, sources: list[Path]) -> str:
    """The cache entry of this build: the sources, the command, torch's version and the entry format. The
    command is hashed with the sources by name and torch's folder as a placeholder (the texts and the version
    are hashed), so every checkout, clone and installed wheel of the same sources shares one entry."""
    torch_dir = str(Path(torch.__file__).parent)
    command = [arg.replace(torch_dir, "TORCH") for arg in _command(cxx, [Path(s.name) for s in sources], Path("OUT"))]
    texts = [(_CSRC / name).read_text() for name in (*_SOURCES, *_HEADERS)]
    return hashlib.sha256("\0".join([torch.__version__, _ENTRY_FORMAT, *command, *texts]).encode()).hexdigest()[:16]


def _cached_or_built(cxx: str, sources: list[Path], folder: Path, name: str) -> Path:
    """Load the library of entry ``folder / name``, building and storing it first when it is missing or
    damaged. A cache that cannot be written (read-only, full) is skipped: the build is loaded from a
    private temporary folder instead."""
    entry = folder / name
    try:
        private_dir(folder, cache_root())
        usable = True
        if verify_entry(entry):
            _load(entry / _LIBRARY, entry)
            return entry / _LIBRARY
    except OSError as exc:
        warn_no_cache("kernel", folder, exc)
        usable = False
    print(f"kvcore: building its C++ CPU kernels for this machine with {cxx} (once; up to a few minutes)",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="kvcore-kernels-") as tmp:  # private (0700), off the cache disk
        built = _build(cxx, sources, Path(tmp))
        if usable:
            try:
                write_entry(folder, name, lambda new: shutil.copyfile(built, new / _LIBRARY))
                if not verify_entry(entry):  # another process's entry got there first and is damaged
                    raise OSError(f"the new entry {entry} did not verify")
            except OSError as exc:
                warn_no_cache("kernel", folder, exc)
            else:
                _load(entry / _LIBRARY, entry)
                return entry / _LIBRARY
        _load(built, None)  # mapped now: the folder can go
        return built


def kernels_built() -> bool:
    """Whether the kernels for this machine and torch are already built (so :func:`load_kernels` only loads)."""
    if kernel_reasons():
        return False
    sources = [_CSRC / name for name in _SOURCES]
    return verify_entry(cache_root() / "kernels" / _entry_name(cxx_compiler(), sources))


def kernels_loaded() -> bool:
    """Whether :func:`load_kernels` has loaded the kernels into this process (it never builds or loads them)."""
    return load_kernels.cache_info().currsize > 0


@functools.cache
def load_kernels() -> str:
    """Build (once per machine and torch version) and load the kernels; returns the library's path.
    Raises :class:`~kvcore.errors.BackendUnavailableError` with the reason when they cannot be built
    (:class:`~kvcore.errors.KernelBuildError` when the compiler failed), and
    :class:`~kvcore.errors.CacheTrustError` when the cache folder is not the user's own."""
    reasons = kernel_reasons()
    if reasons:
        raise BackendUnavailableError("; ".join(reasons))
    cxx = cxx_compiler()
    sources = [_CSRC / name for name in _SOURCES]
    library = _cached_or_built(cxx, sources, cache_root() / "kernels", _entry_name(cxx, sources))
    register_fakes()
    return str(library)


def extension_reasons(feature: str) -> list[str]:
    """Why the kernels are not compiled with ``feature`` (``"avx512_vnni"`` or ``"avx512_bf16"``) on this CPU
    ([] = they are): the CPU must report it, on top of the AVX-512 build."""
    if feature in cpu_features().flags and vector_isa() == "avx512":
        return []
    return [f"this CPU does not report {feature} with AVX-512; it reports "
            f"{', '.join(cpu_features().flags) or 'no SIMD flags'}"]


def int8_dot_isa() -> str | None:
    """The instructions of the ``int4a8`` and ``gguf`` kernels' integer x int8 dot products on this CPU:
    ``"avx512_vnni"`` (vpdpbusd), ``"avx2_dot"`` (AVX2's vpmaddubsw, on any AVX2 or AVX-512 CPU without VNNI),
    or None (the kernels would run portable loops)."""
    if not extension_reasons("avx512_vnni"):
        return "avx512_vnni"
    return "avx2_dot" if vector_isa() != "portable" else None


def int4a8_reasons(fmt: str = "int4a8") -> list[str]:
    """Why the kernels of the ``int4a8`` (or ``gguf``) weight format cannot run here ([] = they can)."""
    reasons = kernel_reasons()
    if int8_dot_isa() is None:
        reasons.append(f"{fmt} needs a CPU with AVX2 (with FMA and F16C) or AVX512-VNNI (its integer x int8 dot "
                       f"products); this one reports {', '.join(cpu_features().flags) or 'no SIMD flags'}")
    return reasons


@functools.cache
def bf16_linear_ready() -> bool:
    """Whether ``torch.ops.kvcore.bf16_linear`` runs here: a CPU with AVX512_BF16 and kernels that build (once)."""
    if extension_reasons("avx512_bf16") or kernel_reasons():
        return False
    try:
        load_kernels()
    except BackendUnavailableError:
        return False
    return bool(torch.ops.kvcore.built_with("avx512_bf16"))
