"""Q4_0 / Q4_1 blocks reordered straight into the int4a8 kernel's layout (kvcore.loaders.gguf_codes.int4a8_layout):
the same bytes as decoding their codes and packing them, for the embedded SmolLM2 file and real-shape files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from kvcore.kernels.quant import pack_int4a8
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
