"""int4a8 weights made in one native pass (kvcore/kernels/csrc/int4a8_pack.cpp): Q4_0 / Q4_1 blocks reordered
straight into the kernel's layout (kvcore.loaders.gguf_codes.int4a8_layout), the same bytes as decoding their codes
and packing them, for the embedded SmolLM2 file and real-shape files; and float rows quantized and packed
(``int4a8_quantize``, the int4 LM head), the same bytes as ``Int4Groups.from_float`` then ``pack_int4a8``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from kvcore.kernels.cpu_kernels import load_kernels
from kvcore.kernels.quant import Int4Groups, pack_int4a8
from kvcore.loaders import load_model
from kvcore.loaders.gguf_blocks import GGUFBlocks
from kvcore_bench.real_size import Shape, write_gguf

SMALL = Shape(hidden=64, layers=2, ffn=128, heads=4, kv_heads=2, head_dim=16)


def _layer_blocks(spec: str):
    loaded = load_model(spec, keep_quantized=True)
    return [w for n, w in loaded.weights.items() if n.startswith("model.layers.") and isinstance(w, GGUFBlocks)]


def _check_same(blocks: list[GGUFBlocks]) -> None:
    assert blocks
    for w in blocks:
        codes, dm = w.int4a8_layout()
        want_codes, want_dm = pack_int4a8(w.codes())
        assert codes.dtype == want_codes.dtype and dm.dtype == want_dm.dtype, w
        assert torch.equal(codes, want_codes) and torch.equal(dm, want_dm), w


def test_smollm2_q4_1_blocks_are_the_packed_codes():
    blocks = _layer_blocks("smollm2")
    assert {w.qtype for w in blocks} == {QType.Q4_1}
    _check_same(blocks[:14])  # two layers' worth: every kind of projection, with the Q/K row order undone


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1"])
def test_written_blocks_are_the_packed_codes(tmp_path, qtype):
    path = write_gguf(tmp_path / f"small-{qtype}.gguf", SMALL, qtype)
    blocks = _layer_blocks(str(path))
    assert {w.qtype.name.lower() for w in blocks} == {qtype}
    _check_same(blocks)


def test_other_blocks_have_no_layout():
    q8 = GGUFBlocks(QType.Q8_0, np.zeros((16, 34), dtype=np.uint8), (16, 32))
    assert q8.int4a8_layout() is None
    odd = GGUFBlocks(QType.Q4_1, np.zeros((8, 20), dtype=np.uint8), (8, 32))  # not whole blocks of 16 rows
    assert odd.int4a8_layout() is None
    big = np.zeros((16, 18), dtype=np.uint8)
    big[:, 0:2] = np.frombuffer(np.float16(60000).tobytes(), dtype=np.uint8)  # -8 d overflows float16
    assert GGUFBlocks(QType.Q4_0, big, (16, 32)).int4a8_layout() is None
    assert pack_int4a8(GGUFBlocks(QType.Q4_0, big, (16, 32)).codes())[1].dtype == torch.float32


def _quantized_natively(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    load_kernels()
    n, k = w.shape
    codes = torch.full((n // 16, k // 32, 256), 0xAA, dtype=torch.uint8)  # every byte must be written
    dm = torch.full((n // 16, k // 32, 2, 16), float("nan"), dtype=torch.float16)
    torch.ops.kvcore.int4a8_quantize(w, codes, dm)
    return codes, dm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_float_rows_quantize_to_the_same_bytes_as_from_float_and_pack(dtype):
    """Random rows of every magnitude, plus the cases rounding gets wrong first: constant groups (scale clamped),
    values exactly halfway between two steps (ties to even), and a group of a single outlier."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * 10.0 ** torch.randint(-4, 3, (64, 1), generator=g)
    w[3, :32] = 0.25  # constant group
    w[5, :32] = torch.arange(32) * 0.5  # evenly spaced
    w[7, 32:64] = 0.0
    w[7, 40] = 3.0  # one outlier
    # s = 1 and z = 8 exactly: k + 0.5 lies halfway between two codes (even and odd ones: ties go to even)
    w[9, 64:96] = torch.tensor([0.0, 15.0] + [k + 0.5 for k in range(15)] * 2)
    w = w.to(dtype)
    steps = (w[9, 64:96].float() - 8) / 1
    assert (steps - steps.floor() == 0.5).sum() == 30  # the ties are there in every dtype
    codes, dm = _quantized_natively(w.contiguous())
    want_codes, want_dm = pack_int4a8(Int4Groups.from_float(w, 32, dtype))
    assert want_dm.dtype == torch.float16
    assert torch.equal(codes, want_codes)
    assert torch.equal(dm.view(torch.int16), want_dm.view(torch.int16))


def test_the_smollm2_head_quantizes_to_the_same_bytes():
    """The head the default configuration builds (SmolLM2's Q8_0 token table in bfloat16), all of its rows."""
    loaded = load_model("smollm2", keep_quantized=True)
    table = loaded.weights["model.embed_tokens.weight"]
    w = table.dequantize(torch.bfloat16)
    codes, dm = _quantized_natively(w)
    want_codes, want_dm = pack_int4a8(Int4Groups.from_float(w, 32, torch.bfloat16))
    assert torch.equal(codes, want_codes) and torch.equal(dm.view(torch.int16), want_dm.view(torch.int16))
