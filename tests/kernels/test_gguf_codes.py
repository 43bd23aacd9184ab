"""GGUF blocks run natively (the ``gguf`` weight format): Q4_0 ... Q6_K decoded into codes with a float32 scale and
offset per group, equal to the ``gguf`` package's dequantization; the int8-group and int4a8 kernels on them."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from kvcore.engine.config import EngineConfig
from kvcore.engine.defaults import ModelFacts, choose_defaults, file_facts
from kvcore.kernels.cpu_kernels import int4a8_reasons
from kvcore.kernels.group_quant import GroupCodes, Int8GroupLinear
from kvcore.kernels.quant import Int4A8Linear
from kvcore.loaders import gguf_blocks
from kvcore.loaders.gguf_blocks import CODE_TYPES, GGUFBlocks, file_blocks
from kvcore.loaders.gguf_codes import SCALE_OFFSETS

needs_kernel = pytest.mark.skipif(bool(int4a8_reasons()), reason="; ".join(int4a8_reasons()))
#: a real K-quant mix (see test_gemma3_gguf.py for where to get it); opt-in, so the suite needs no 250 MB file
GEMMA3 = Path(os.environ.get("KVCORE_GEMMA3_GGUF", "") or "/nonexistent")
needs_gemma3 = pytest.mark.skipif(not GEMMA3.is_file(), reason="set KVCORE_GEMMA3_GGUF to a Gemma 3 270M Q4_K_M GGUF")



def _random_blocks(qtype: QType, rows: int, blocks_per_row: int, seed: int) -> GGUFBlocks:
    """Random codes and sub-scales (every byte random) with finite float16 scales of all magnitudes, subnormal
    and negative ones included."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, blocks_per_row, type_size), dtype=np.uint8)
    for at in SCALE_OFFSETS[qtype]:
        scales = rng.standard_normal((rows, blocks_per_row, 1)) * 10.0 ** rng.integers(-7, 2, (rows, blocks_per_row, 1))
        data[..., at:at + 2] = scales.astype(np.float16).view(np.uint8)
    return GGUFBlocks(qtype, data.reshape(rows, -1), (rows, blocks_per_row * block_size))


def _reference(blocks: GGUFBlocks) -> torch.Tensor:
    values = gguf.quants.dequantize(blocks.data, blocks.qtype).reshape(blocks.shape)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, with -0 and +0 one value (``d (q - 8)`` is a signed zero where ``d q - 8 d`` is +0)."""
    return torch.equal((a + 0.0).view(torch.int32), (b + 0.0).view(torch.int32))


def test_every_code_type_is_covered():
    assert set(CODE_TYPES) == set(SCALE_OFFSETS)


@pytest.mark.parametrize("qtype", CODE_TYPES, ids=lambda t: t.name)
def test_a_non_finite_scale_is_found(qtype):
    """Every float16 scale field is read by the load's NaN / infinity check (a missed field passes bad weights)."""
    for at in SCALE_OFFSETS[qtype]:
        blocks = _random_blocks(qtype, rows=2, blocks_per_row=2, seed=1)
        assert blocks.is_finite()
        type_size = gguf.GGML_QUANT_SIZES[qtype][1]
        blocks.data.reshape(-1, type_size)[3, at:at + 2] = np.array([np.nan], np.float16).view(np.uint8)
        assert not blocks.is_finite()
        assert not bool(torch.isfinite(_reference(blocks)).all())


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_scale_in_a_later_piece_of_the_file_is_found(tmp_path, monkeypatch, bad):
    """Blocks as stored in a file are checked a piece at a time: a bad scale past the first piece is still found,
    and the largest finite float16 scales are not taken for infinities."""
    monkeypatch.setattr(gguf_blocks, "_SCAN_BLOCKS", 4)  # pieces of 4 blocks: the bad one lies in the fourth
    type_size = gguf.GGML_QUANT_SIZES[QType.Q4_1][1]
    data = _random_blocks(QType.Q4_1, rows=4, blocks_per_row=4, seed=2).data.reshape(-1, type_size)
    data[:, 0:2] = np.array([65504.0], np.float16).view(np.uint8)  # d: the largest finite value
    data[:, 2:4] = np.array([-65504.0], np.float16).view(np.uint8)  # m
    path = tmp_path / "blocks.bin"
    path.write_bytes(b"\0" * 24 + data.tobytes())
    def stored():
        return GGUFBlocks(QType.Q4_1, file_blocks(path, 24, data.nbytes), (4, 4 * 32))
    assert stored().is_finite()
    data[14, 2:4] = np.array([bad], np.float16).view(np.uint8)
    path.write_bytes(b"\0" * 24 + data.tobytes())
    assert not stored().is_finite()


@pytest.mark.parametrize("qtype", CODE_TYPES, ids=lambda t: t.name)
def test_codes_equal_gguf_dequantization_on_random_blocks(qtype):
    blocks = _random_blocks(qtype, rows=8, blocks_per_row=3, seed=int(qtype))
    codes = blocks.codes()
    assert codes.q.dtype == torch.uint8 and int(codes.q.max()) < 2 ** codes.bits
    assert codes.group_size == (16 if qtype == QType.Q6_K else 32)
    assert _same_bits(codes.dequantize(), _reference(blocks))
    assert _same_bits(blocks.dequantize(), _reference(blocks))


def test_a_wrong_bit_in_the_decoder_is_caught():
    """The comparison sees one flipped high bit of one Q5_K code (a decoder reading qh one shift off would)."""
    blocks = _random_blocks(QType.Q5_K, rows=2, blocks_per_row=1, seed=3)
    codes = blocks.codes()
    codes.q[0, 40] ^= 16
    assert not _same_bits(codes.dequantize(), _reference(blocks))


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K], ids=lambda t: t.name)
def test_fused_parts_regroup_exactly(qtype):
    """A fused matmul of a group-16 and a group-32 part: both in groups of 16, values unchanged."""
    other = _random_blocks(QType.Q8_0, rows=16, blocks_per_row=8, seed=1)
    blocks = _random_blocks(qtype, rows=16, blocks_per_row=1, seed=2)
    fused = GroupCodes.cat([other.codes(), blocks.codes()])
    assert fused.group_size == min(other.codes().group_size, blocks.codes().group_size)
    assert fused.bits == 8
    assert _same_bits(fused.dequantize(), torch.cat([_reference(other), _reference(blocks)]))


def test_the_int4_form_of_q4_k():
    blocks = _random_blocks(QType.Q4_K, rows=4, blocks_per_row=1, seed=5)
    groups = blocks.int4_groups()
    # (q - 8) s + z rounds z = m + 8 d and the sum: float32 steps of the offset's size, not of the weight's
    bound = 2.0**-22 * (groups.zeros.abs() + 8 * groups.scales.abs()).repeat_interleave(32, dim=1)
    assert bool(((groups.dequantize() - _reference(blocks)).abs() <= bound).all())
    with pytest.raises(ValueError, match="no int4 form"):
        _random_blocks(QType.Q5_0, rows=1, blocks_per_row=8, seed=0).int4_groups()


def _emulated(codes: GroupCodes, x: torch.Tensor) -> torch.Tensor:
    """The kernels' arithmetic in float64: x quantized to int8 per row and group (a = max|x| / 127), then
    sum_g d a (q . p) + m a sum(p), with d and m exactly as stored."""
    n, k = codes.shape
    g = codes.group_size
    xf = x.float().view(x.shape[0], k // g, g)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127).div(amax), torch.zeros_like(amax))
    p, a = (xf * inv).round().double(), (amax / 127).double().squeeze(-1)
    q = codes.q.double().view(n, k // g, g)
    dots = torch.einsum("rgk,ngk->rng", p, q)
    sums = a * p.sum(-1)  # [M, G]: the quantized activations' sums, as llama.cpp's Q8_1 blocks carry them
    return (dots * codes.d.double()[None] * a[:, None] + codes.m.double()[None] * sums[:, None]).sum(-1)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 17])
@pytest.mark.parametrize("qtype", [QType.Q5_0, QType.Q5_K, QType.Q6_K, QType.Q8_0, QType.Q4_K], ids=lambda t: t.name)
def test_kernels_equal_their_arithmetic(qtype, rows):
    """Every code, scale and offset lands where the kernel reads it (a layout slip is an O(1) error)."""
    blocks = _random_blocks(qtype, rows=32, blocks_per_row=2 if qtype in (QType.Q4_K, QType.Q5_K, QType.Q6_K) else 16,
                            seed=rows)
    codes = blocks.codes()
    x = torch.randn(rows, codes.shape[1], generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    x[0, :32] = 0  # an all-zero activation group (scale 0)
    want = _emulated(codes, x)
    scale = want.abs().amax().item()
    kernels = [Int8GroupLinear(codes)] + ([Int4A8Linear(codes)] if codes.bits == 4 else [])
    for lin in kernels:
        got = lin(x).double()
        assert got.shape == (rows, 32)
        # the output's bfloat16 rounding, and float32 sums of terms as large as the biggest output
        assert bool(((got - want).abs() <= 2.0**-7 * want.abs() + 1e-4 * scale).all()), type(lin).__name__


@needs_kernel
@pytest.mark.parametrize("rows", [1, 16, 17])
def test_the_largest_8_bit_codes_do_not_overflow(rows):
    """Q8_0 codes 127 (255 with the offset) against activation codes +-127: the largest sums the 8-bit kernel
    forms (the AVX2 path splits the codes into nibbles so that its int16 sums cannot wrap or saturate)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[QType.Q8_0]
    data = np.full((32, 4, type_size), 0x7F, dtype=np.uint8)
    data[..., 0:2] = np.float16(0.01).reshape(1).view(np.uint8)
    blocks = GGUFBlocks(QType.Q8_0, data.reshape(32, -1), (32, 4 * block_size))
    x = torch.ones(rows, 4 * block_size, dtype=torch.bfloat16)
    x[::2] = -1
    codes = blocks.codes()
    got, want = Int8GroupLinear(codes)(x).double(), _emulated(codes, x)
    assert bool(((got - want).abs() <= 2.0**-7 * want.abs() + 1e-4 * want.abs().amax()).all())
    assert abs(float(got[0, 0]) + 1.27 * 4 * block_size) <= 2.0**-6 * 1.27 * 4 * block_size


@needs_kernel
def test_q4_k_keeps_its_float32_scales_on_the_int4a8_kernel():
    """d sc of Q4_K has up to 17 significant bits: float16 would round it, so the packing keeps float32."""
    blocks = _random_blocks(QType.Q4_K, rows=16, blocks_per_row=1, seed=9)
    assert Int4A8Linear(blocks.codes()).dm.dtype == torch.float32
    q4_0 = _random_blocks(QType.Q4_0, rows=16, blocks_per_row=8, seed=9)
    assert Int4A8Linear(q4_0.codes()).dm.dtype == torch.float16  # exact in float16: half the scale bytes


#: native matmul vs x @ dequantized.T, relative Frobenius error on Gemma 3 270M's tensors with Gaussian
#: activations (int8 activations per group are the whole difference; with the exact activation sums in the
#: offset term instead of the quantized ones it was several times larger)
NATIVE_MATMUL_RTOL = 0.01


@needs_gemma3
@needs_kernel
@pytest.mark.slow
def test_real_k_quant_file_codes_and_matmuls():
    """One tensor of every type in a real Q4_K_M file: codes equal gguf's dequantization, and the native matmul
    is within NATIVE_MATMUL_RTOL of the dequantized reference."""
    reader = gguf.GGUFReader(GEMMA3)
    seen: set[QType] = set()
    for tensor in reader.tensors:
        if not tensor.name.startswith("blk.") or len(tensor.shape) != 2 or tensor.tensor_type in seen:
            continue
        seen.add(tensor.tensor_type)
        shape = tuple(int(n) for n in reversed(tensor.shape))
        blocks = GGUFBlocks(tensor.tensor_type, tensor.data, shape)
        ref = _reference(blocks)
        codes = blocks.codes()
        assert _same_bits(codes.dequantize(), ref), tensor.name
        x = torch.randn(4, shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        want = x.float() @ ref.t()
        lin = Int4A8Linear(codes) if codes.bits == 4 else Int8GroupLinear(codes)
        err = ((lin(x).float() - want).norm() / want.norm()).item()
        assert err < NATIVE_MATMUL_RTOL, (tensor.name, err)
    assert seen == {QType.Q4_K, QType.Q5_0, QType.Q6_K, QType.Q8_0}


@needs_gemma3
def test_auto_runs_a_k_quant_file_as_stored(monkeypatch):
    facts = file_facts(str(GEMMA3))
    assert facts.native_codes and not facts.native_int4
    monkeypatch.setattr("kvcore.kernels.cpu_kernels.int4a8_reasons", lambda fmt="int4a8": [])
    choice = choose_defaults(EngineConfig(), facts)
    assert (choice.dtype, choice.weights) == ("bfloat16", "gguf")
    assert choose_defaults(EngineConfig(dtype="float32"), facts).weights == "float"


def test_auto_stays_float32_without_the_kernels(monkeypatch):
    monkeypatch.setattr("kvcore.kernels.cpu_kernels.int4a8_reasons", lambda fmt="int4a8": [f"{fmt} cannot run"])
    choice = choose_defaults(EngineConfig(), ModelFacts(native_codes=True))
    assert (choice.dtype, choice.weights) == ("float32", "float")


def _quantized(w: torch.Tensor, qtype: QType) -> GGUFBlocks:
    """``w`` in ``qtype`` blocks (gguf's own quantizer)."""
    data = gguf.quants.quantize(w.detach().float().numpy(), qtype)
    return GGUFBlocks(qtype, data, tuple(w.shape))


def _k_blocks(qtype: QType, rows: int, cols: int, seed: int) -> GGUFBlocks:
    """Random K-quant blocks (gguf has no K-quant quantizer) with float16 scales small enough for a model."""
    blocks = _random_blocks(qtype, rows, cols // 256, seed)
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    for at in SCALE_OFFSETS[qtype]:
        blocks.data.reshape(-1, type_size)[:, at:at + 2] = np.array([2e-4], np.float16).view(np.uint8)
    return blocks


@needs_kernel
def test_a_model_of_mixed_blocks_runs_each_on_its_kernel():
    """A K-quant mix as llama.cpp lays it out (Q5_0 Q/K, Q8_0 V, Q4_K output, Q5_1 gate/up, Q6_K down): every matmul
    on the kernel for its blocks, logits close to the float32 model on the dequantized weights."""
    from helpers import full_attention, make_random_model, weights_of

    from kvcore.model.decoder import LlamaModel
    from kvcore.model.weights import LINEAR_PARTS

    model = make_random_model(num_heads=4, num_kv_heads=2, head_dim=64, num_layers=2)  # hidden 256: K-quant rows
    weights = dict(weights_of(model))
    types = {"q_proj": QType.Q5_0, "k_proj": QType.Q5_0, "v_proj": QType.Q8_0, "gate_proj": QType.Q5_1,
             "up_proj": QType.Q5_1}
    for i in range(model.config.num_hidden_layers):
        for part, qtype in types.items():
            name = next(n for n in weights if n.startswith(f"model.layers.{i}.") and f".{part}." in n)
            weights[name] = _quantized(weights[name], qtype)
        for part, qtype in (("self_attn.o_proj", QType.Q4_K), ("mlp.down_proj", QType.Q6_K)):
            name = f"model.layers.{i}.{part}.weight"
            weights[name] = _k_blocks(qtype, *weights[name].shape, seed=i)
    native = LlamaModel.from_weights(model.config, weights, torch.bfloat16, weight_format="gguf")
    kinds = {name: type(native._quantized[name][0]).__name__ for name in ("qkv", "o", "gate_up", "down")}
    assert kinds == {"qkv": "Int8GroupLinear", "o": "Int4A8Linear", "gate_up": "Int8GroupLinear",
                     "down": "Int8GroupLinear"}
    assert native._quantized["down"][0].group_size == 16 and native._quantized["o"][0].dm.dtype == torch.float32
    dense = {n: w.dequantize() if isinstance(w, GGUFBlocks) else w for n, w in weights.items()}
    for name, parts in LINEAR_PARTS.items():  # each fused matmul (regrouped, packed) against its float weights
        w = torch.cat([dense[f"model.layers.1.{part}"] for part in parts])
        x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        want = x.float() @ w.t()
        assert ((native._quantized[name][1](x).float() - want).norm() / want.norm()).item() < NATIVE_MATMUL_RTOL
    # the whole forward: the activations' int8 rounding compounds over the layers of an untrained model (a layout
    # or scale slip gives errors of the logits' own size)
    reference = LlamaModel.from_weights(model.config, dense, torch.float32)
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(0))
    got, want = (m.compute_logits(m(ids, torch.arange(12), full_attention)).float() for m in (native, reference))
    assert ((got - want).norm() / want.norm()).item() < 0.5
    # a fused matmul with a part the format has no codes for (here float) stays dense
    weights["model.layers.0.self_attn.v_proj.weight"] = dense["model.layers.0.self_attn.v_proj.weight"]
    mixed = LlamaModel.from_weights(model.config, weights, torch.bfloat16, weight_format="gguf")
    assert type(mixed._quantized["qkv"][0]).__name__ == "DenseLinear"
