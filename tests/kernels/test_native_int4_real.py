"""The embedded Q4_1 file's own tensors on the native kernels: every layer matmul of the bfloat16 default
(``int4a8``) and of ``int4`` against the file's dequantized weights, on the activations a real prompt gives
them (captured from the float32 reference), not random ones.

A wrong zero point, nibble order, row permutation or packing makes some matmul tens of percent off; what is
left when all are right is the formats' own rounding: bfloat16 scales (``int4``), int8 activations per group
of 32 as llama.cpp's Q8 blocks (``int4a8``), bounds measured in benchmarks/results/fast-default.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import full_attention

from kvcore.kernels.cpu_kernels import int4a8_reasons
from kvcore.loaders import build_model, load_model
from kvcore.model.weights import quantized_linears

pytestmark = pytest.mark.slow

#: the largest relative error ``|y - y_ref| / |y_ref|`` of one matmul output over the prompt's rows
BOUNDS = {"int4": 0.01, "int4a8": 0.05}
PARTS = ("qkv", "o", "gate_up", "down")


@pytest.fixture(scope="module")
def captured():
    """``(blocks, {part: [per layer: (x [T, in] float32, y_ref [T, out] float32)]})``: each layer matmul's input
    in the float32 reference forward over a golden prompt, and its output on the dequantized weights with that
    input rounded to bfloat16 (what the native kernels are given)."""
    prompt = json.loads((Path(__file__).parents[1] / "data" / "golden_smollm2.json").read_text())["prompts"][0]
    blocks = load_model("smollm2", keep_quantized=True)
    ref = build_model(blocks, torch.float32, max_model_len=128, weights="float")
    ids = torch.tensor(prompt["prompt_token_ids"])
    dense = ref.matmuls(len(ids))
    seen: dict[str, list] = {part: [] for part in PARTS}

    def recording(part: str, fn):
        def call(x: torch.Tensor) -> torch.Tensor:
            seen[part].append((x.detach().clone(), fn(x.bfloat16().float())))
            return fn(x)
        return call

    matmuls = {**dense, **{p: [recording(p, fn) for fn in dense[p]] for p in PARTS}}
    with torch.no_grad():
        ref(ids, torch.arange(len(ids)), full_attention, matmuls)
    return blocks, seen


@pytest.mark.parametrize("fmt", ["int4", "int4a8"])
def test_every_native_matmul_of_the_file_matches_its_dequantized_weights(captured, fmt):
    if fmt == "int4a8" and int4a8_reasons():
        pytest.skip("; ".join(int4a8_reasons()))
    blocks, seen = captured
    native = quantized_linears(blocks.config, blocks.weights, fmt, torch.bfloat16)
    worst = {}
    for part in PARTS:
        for layer, ((x, y_ref), fn) in enumerate(zip(seen[part], native[part], strict=True)):
            assert getattr(fn, "format", None) == fmt, (part, layer, type(fn))  # not a dense fallback
            with torch.no_grad():
                y = fn(x.bfloat16()).float()
            err = float((y - y_ref).norm() / y_ref.norm())
            worst[part] = max(worst.get(part, 0.0), err)
            assert err <= BOUNDS[fmt], f"{fmt} {part} layer {layer}: relative error {err:.4f}"
    assert len(worst) == len(PARTS)
