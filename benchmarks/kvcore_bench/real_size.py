"""Real-shape GGUF files with random weights, for measuring kvcore at real model sizes.

The files have the shapes of real Llama-architecture models (SmolLM2 360M and 1.7B, a 3B and an 8B shape),
SmolLM2's tokenizer and chat template (copied from the embedded SmolLM2 file) and random weights stored as the
embedded file stores them: layer matrices Q4_1 (or Q4_0 / Q8_0 / Q4_K), norms F32 (all ones), the tied token
embedding Q8_0. The work per token is therefore the real one; the text is junk.

Weights are written as random quantized blocks directly (uniform codes, one fp16 scale per tensor chosen for a
weight std of :data:`WEIGHT_STD`, offsets centring the codes on zero; Q4_K's 6-bit sub-block scales and minimums
random too), not quantized from floats: quantizing in numpy would take longer than the measurement. Every tensor
comes from its own generator seeded with ``(seed, tensor index)`` and is written as it is made, so a file is
reproducible and never held in memory whole.

Files live in ``$KVCORE_BENCH_CACHE``, else ``~/.cache/kvcore-bench/real-size/``, named like
``llama-1.7b-q4_1.gguf``; they are written to a temporary name and renamed, and reused when present.

Run (from a venv with kvcore and ``pip install -e ./benchmarks``)::

    python -m kvcore_bench.real_size write 1.7b [--type q4_1]      # prints the file's path

``kvcore bench --real-size`` (:mod:`kvcore_bench.sizes`) measures kvcore and llama.cpp on them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

__all__ = ["SHAPES", "QTYPES", "WEIGHT_STD", "Shape", "cache_dir", "ensure_file", "write_gguf", "cpu_summary", "main"]

#: target standard deviation of every random weight: small enough that activations stay finite and moderate
WEIGHT_STD = 0.02
VOCAB = 49152  # SmolLM2's tokenizer


@dataclasses.dataclass(frozen=True)
class Shape:
    """The dimensions of a Llama-architecture model (tied embedding, SmolLM2's vocabulary)."""

    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int = 64
    rope_theta: float = 130000.0  # SmolLM2-1.7B's
    context: int = 8192


SHAPES: dict[str, Shape] = {
    "360m": Shape(hidden=960, layers=32, ffn=2560, heads=15, kv_heads=5, rope_theta=100000.0),  # SmolLM2-360M
    "1.7b": Shape(hidden=2048, layers=24, ffn=8192, heads=32, kv_heads=32),  # SmolLM2-1.7B
    "3b": Shape(hidden=3072, layers=28, ffn=8192, heads=24, kv_heads=8, head_dim=128),  # Llama 3.2 3B's dims
    "8b": Shape(hidden=4096, layers=32, ffn=14336, heads=32, kv_heads=8, head_dim=128),  # Llama 3.1 8B's dims
}
QTYPES = {"q4_0": QType.Q4_0, "q4_1": QType.Q4_1, "q8_0": QType.Q8_0, "q4_k": QType.Q4_K}
_FILE_TYPES = {QType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0, QType.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
               QType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0, QType.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_S}
# bytes of fp16 scale(s) at the head of each block, and the std of the weights per unit of the first one (uniform
# codes: Q4 ones 0..15 less 8 (Q4_0) or 7.5 (Q4_1, through its offset m), Q8_0's bytes as int8 -128..127; Q4_K's
# weight d * sc * q - dmin * m with sc, m uniform in 0..63 and dmin = 7.5 d: the sub-blocks' spread
# 1333.5 * 21.25 plus their means' 56.25 * 2 * 341.25, in d^2)
_HEAD_BYTES = {QType.Q4_0: 2, QType.Q4_1: 4, QType.Q8_0: 2, QType.Q4_K: 4}
_CODE_STD = {QType.Q4_0: (255 / 12) ** 0.5, QType.Q4_1: (255 / 12) ** 0.5, QType.Q8_0: (65535 / 12) ** 0.5,
             QType.Q4_K: (1333.5 * 21.25 + 56.25 * 2 * 341.25) ** 0.5}


def cache_dir() -> Path:
    """Where the files are kept: ``$KVCORE_BENCH_CACHE``, else ``~/.cache/kvcore-bench/real-size``."""
    env = os.environ.get("KVCORE_BENCH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvcore-bench" / "real-size"


def _tensors(shape: Shape, qtype: QType) -> list[tuple[str, QType, tuple[int, ...]]]:
    """(name, type, numpy shape [out, in]) of every tensor, in the embedded SmolLM2 file's order."""
    d, q_out, kv_out = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out: list[tuple[str, QType, tuple[int, ...]]] = [("token_embd.weight", QType.Q8_0, (VOCAB, d))]
    for i in range(shape.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", QType.F32, (d,)), (b + "ffn_down.weight", qtype, (d, shape.ffn)),
                (b + "ffn_gate.weight", qtype, (shape.ffn, d)), (b + "ffn_up.weight", qtype, (shape.ffn, d)),
                (b + "ffn_norm.weight", QType.F32, (d,)), (b + "attn_k.weight", qtype, (kv_out, d)),
                (b + "attn_output.weight", qtype, (d, q_out)), (b + "attn_q.weight", qtype, (q_out, d)),
                (b + "attn_v.weight", qtype, (kv_out, d))]
    return out + [("output_norm.weight", QType.F32, (d,))]


def _random_tensor(rng: np.random.Generator, qtype: QType, dims: tuple[int, ...]) -> np.ndarray:
    """Random weights as ``qtype`` stores them: F32 norms are ones; quantized ones are ``[rows, bytes per row]``."""
    if qtype == QType.F32:
        return np.ones(dims, np.float32)
    rows, cols = dims
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block} values, not {cols}")
    d = WEIGHT_STD / _CODE_STD[qtype]
    scales = {QType.Q4_1: [d, -7.5 * d], QType.Q4_K: [d, 7.5 * d]}.get(qtype, [d])
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)  # codes: any byte will do
    blocks[:, : _HEAD_BYTES[qtype]] = np.array(scales, "<f2").view(np.uint8)
    return blocks.reshape(rows, cols // block * size)


@functools.cache
def _tokenizer_fields() -> tuple[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None], ...]:
    """Every ``tokenizer.*`` key (vocabulary, merges, special ids, chat template) of the embedded SmolLM2, with
    its value types; read once per process (the reader takes seconds on a 49k-token vocabulary)."""
    from kvcore.loaders.resolve import smollm2_path  # here: importing kvcore is slow, and `startup` needs none

    reader = gguf.GGUFReader(smollm2_path())
    return tuple((key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
                 for key, field in reader.fields.items() if key.startswith("tokenizer."))


def write_gguf(path: str | os.PathLike[str], shape: Shape, qtype: str = "q4_1", seed: int = 0) -> Path:
    """Write a ``shape`` model with random ``qtype`` layer weights to ``path`` (in place: see :func:`ensure_file`)."""
    qt, path = QTYPES[qtype], Path(path)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"kvcore-bench random llama {shape.hidden}x{shape.layers}")
    writer.add_description("random weights for benchmarking (kvcore_bench.real_size): the text is junk")
    writer.add_file_type(_FILE_TYPES[qt])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(VOCAB)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    for key, value, vtype, sub in _tokenizer_fields():
        writer.add_key_value(key, value, vtype, sub_type=sub)
    tensors = _tensors(shape, qt)
    # tensor infos first, then the data one tensor at a time: the writer never holds the model
    for name, tt, dims in tensors:
        block, size = gguf.GGML_QUANT_SIZES[tt]
        nbytes = int(np.prod(dims)) // block * size
        stored = dims if tt == QType.F32 else (dims[0], dims[1] // block * size)
        writer.add_tensor_info(name, stored, np.dtype(np.float32 if tt == QType.F32 else np.uint8), nbytes,
                               raw_dtype=None if tt == QType.F32 else tt)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for index, (_, tt, dims) in enumerate(tensors):
            writer.write_tensor_data(_random_tensor(np.random.default_rng([seed, index]), tt, dims))
    finally:
        writer.close()
    return path


def file_name(shape: str, qtype: str) -> str:
    return f"llama-{shape}-{qtype}.gguf"


def ensure_file(shape: str, qtype: str = "q4_1", cache: Path | None = None) -> Path:
    """The cached file of a named shape, written first (to a temporary name, then renamed) if absent."""
    folder = cache or cache_dir()
    path = folder / file_name(shape, qtype)
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write_gguf(tmp, SHAPES[shape], qtype)
        os.replace(tmp, path)  # readers see the whole file or none
    finally:
        tmp.unlink(missing_ok=True)
    return path


def cpu_summary() -> tuple[str, str]:
    """The CPU's model name and which of the instruction sets kvcore's kernels use it has."""
    name, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    wanted = ["avx2", "avx512f", "avx512_bf16", "avx512_vnni"]
    have = [f for f in wanted if f in flags] + (["amx"] if any(f.startswith("amx") for f in flags) else [])
    return name, " ".join(have) or "none of avx2/avx512/amx"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcore_bench.real_size", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    write = sub.add_parser("write", help="write (or find) a shape's file and print its path")
    write.add_argument("shape", choices=SHAPES)
    write.add_argument("--type", dest="qtype", choices=QTYPES, default="q4_1", help="layer weights (default q4_1)")
    args = parser.parse_args(argv)
    print(ensure_file(args.shape, args.qtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
