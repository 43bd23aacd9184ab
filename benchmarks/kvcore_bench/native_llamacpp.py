"""Native llama.cpp as the peer: ``llama-bench``, ``llama-batched-bench``, and for accuracy ``llama-quantize`` and
``llama-perplexity``, built on request from the llama.cpp
source vendored in the ``llama-cpp-python`` sdist (what a llama.cpp user runs, not the Python binding's loop).

``build_tools()`` downloads the sdist with pip (``pip download --no-binary :all: --no-deps llama-cpp-python``),
configures ``vendor/llama.cpp`` with CMake for this CPU (``GGML_NATIVE=ON``, static, no CURL/server) and builds the
tools with ``-j2`` (a few minutes). The binaries are kept under ``$KVCORE_CACHE_DIR/llamacpp/<version>/``, so
later runs reuse them. ``llama_bench`` / ``batched_bench`` run one measurement and parse the tools' JSON output;
``dequantize_f32`` and ``kl_divergence`` measure a quantized file against its float32 form as ``llama-perplexity
--kl-divergence`` does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["TOOLS", "tools_dir", "build_tools", "llama_bench", "batched_bench", "dequantize_f32", "kl_divergence"]

TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-perplexity")
_CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
                "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF")


def tools_dir() -> Path:
    """Where built tools are kept: ``<kvcore cache>/llamacpp``."""
    from kvcore.loaders.model_cache import cache_root

    return cache_root() / "llamacpp"


def _found(root: Path) -> Path | None:
    for bin_dir in sorted(root.glob("*/bin"), reverse=True):
        if all((bin_dir / t).is_file() for t in TOOLS):
            return bin_dir
    return None


def build_tools(root: Path | None = None, jobs: int = 2, progress: bool = True) -> Path:
    """The directory holding the :data:`TOOLS`: found under ``root`` (default
    :func:`tools_dir`), else built there from the sdist. Raises ConfigError when a step fails."""
    from kvcore.errors import ConfigError

    root = root or tools_dir()
    found = _found(root)
    if found is not None:
        return found
    root.mkdir(parents=True, exist_ok=True)

    def step(what: str, command: list[str], cwd: Path | None = None) -> None:
        if progress:
            print(f"llama.cpp: {what}", file=sys.stderr, flush=True)
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise ConfigError(f"building llama.cpp failed at '{what}': {' / '.join(tail)[:400]}")

    with tempfile.TemporaryDirectory(dir=root) as tmp:
        tmp_path = Path(tmp)
        step("pip download llama-cpp-python (sdist)",
             [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q", "-d", tmp,
              "llama-cpp-python"])
        sdist = next(tmp_path.glob("llama_cpp_python-*.tar.gz"))
        version = sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp_path, filter="data")
        source = tmp_path / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
        build = source / "build"
        step("cmake configure", ["cmake", "-S", str(source), "-B", str(build), *_CMAKE_FLAGS])
        step(f"cmake build {' '.join(TOOLS)} (-j{jobs}, a few minutes)",
             ["cmake", "--build", str(build), f"-j{jobs}", "--target", *TOOLS])
        bin_dir = root / version / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        for tool in TOOLS:
            os.replace(build / "bin" / tool, bin_dir / tool)
    return bin_dir


def _run_json(command: list[str]) -> list[dict[str, Any]]:
    text = _run(command, stderr=False).strip()
    if text.startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def llama_bench(bin_dir: Path, gguf: Path, threads: int, n_gen: int = 128, reps: int = 1,
                n_prompt: int = 0) -> dict[str, Any]:
    """``llama-bench -p n_prompt -n n_gen`` (llama.cpp's tg128 at the default; ``n_gen=0, n_prompt=512``: its
    pp512): its JSON row (``avg_ts`` tok/s, ``cpu_info``, ``backends``, ``build_commit``...)."""
    if bool(n_gen) == bool(n_prompt):
        raise ValueError("llama_bench measures generation or a prompt, one at a time")
    rows = _run_json([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(n_prompt),
                      "-n", str(n_gen), "-r", str(reps), "-o", "json"])
    return rows[0]


def batched_bench(bin_dir: Path, gguf: Path, threads: int, npl: list[int], npp: int, ntg: int,
                  ctx: int, shared_prompt: bool = False) -> list[dict[str, Any]]:
    """``llama-batched-bench -npl ...`` (parallel sequences, each ``npp`` prompt tokens then ``ntg`` generated):
    one JSON row per parallel count (``speed_tg``: aggregate generation tok/s; ``t_pp``: the prefill, s).
    ``--no-repack``: on a VM whose CPU reports AMX, batched steps on ggml's repacked (AMX) weight buffers died of
    SIGILL; without them llama.cpp runs its AVX-512 kernels on the blocks as stored. ``shared_prompt``: one
    prompt computed once and its cells shared by every sequence in one unified KV buffer (``-pps -kvu``)."""
    shared = ["-pps", "-kvu"] if shared_prompt else []
    return _run_json([str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-c", str(ctx),
                      "-b", "2048", "-ub", "512", "-npp", str(npp), "-ntg", str(ntg), "--no-repack", *shared,
                      "-npl", ",".join(map(str, npl)), "--output-format", "jsonl"])


def _run(command: list[str], stderr: bool = True) -> str:
    """The tool's standard output (and, with ``stderr``, its standard error after it); ConfigError naming how it
    ended and its last line of standard error when it fails."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        from kvcore.errors import ConfigError

        why = f"signal {-done.returncode}" if done.returncode < 0 else f"exit code {done.returncode}"
        raise ConfigError(f"{Path(command[0]).name} failed ({why}): {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout + (done.stderr if stderr else "")


def dequantize_f32(bin_dir: Path, gguf: Path, out: Path, threads: int) -> Path:
    """``out``: ``gguf`` with every tensor dequantized to float32 (``llama-quantize --allow-requantize ... F32``)."""
    _run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), str(out), "F32", str(threads)])
    return out


def _number(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    if found is None:
        raise ValueError(f"llama-perplexity printed no match for {pattern!r}")
    return float(found.group(1))


def kl_divergence(bin_dir: Path, base: Path, gguf: Path, text: Path, ctx: int, threads: int,
                  work: Path) -> dict[str, Any]:
    """``llama-perplexity --kl-divergence`` of ``gguf`` against ``base`` (its float32 form) on ``text`` in chunks of
    ``ctx``: mean KL divergence (± its standard error), top-1 agreement ("same top p"), both perplexities."""
    saved = work / "base.kld"
    common = ["-f", str(text), "-c", str(ctx), "-b", str(max(ctx, 512)), "-t", str(threads)]
    _run([str(bin_dir / "llama-perplexity"), "-m", str(base), "--kl-divergence-base", str(saved), *common])
    out = _run([str(bin_dir / "llama-perplexity"), "-m", str(gguf), "--kl-divergence-base", str(saved),
                "--kl-divergence", *common])
    return {"mean_kld": _number(r"Mean\s+KLD:\s+([-\d.]+)", out),
            "mean_kld_err": _number(r"Mean\s+KLD:\s+[-\d.]+\s+±\s+([-\d.]+)", out),
            "same_top_p": _number(r"Same top p:\s+([\d.]+)", out) / 100,
            "ppl_base": _number(r"Mean PPL\(base\)\s+:\s+([\d.]+)", out),
            "ppl": _number(r"Mean PPL\(Q\)\s+:\s+([\d.]+)", out),
            "positions": (ctx - 1 - ctx // 2) * int(_number(r"computing over (\d+) chunks", out))}
