"""A quantized model's token table held as GGUF blocks (kvcore/model/embedding.py): the rows it decodes, for the
embedding lookup and the int4 head's rescoring, are exactly those of the whole table dequantized."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from helpers import full_attention, make_random_model, weights_of

from kvcore.kernels.cpu_kernels import int4a8_reasons, kernel_reasons, load_kernels
from kvcore.kernels.quant import quantized_reasons
from kvcore.loaders import gguf_blocks
from kvcore.loaders.gguf_blocks import CODE_TYPES, GGUFBlocks
from kvcore.loaders.gguf_codes import SCALE_OFFSETS
from kvcore.model.decoder import DecoderModel
from kvcore.model.embedding import BlockTable, head_rows
from kvcore.model.lm_head import RescoredInt4Head

needs_kernel = pytest.mark.skipif(bool(int4a8_reasons()), reason="; ".join(int4a8_reasons()))


def _blocks(qtype: QType, rows: int, cols: int, seed: int = 0) -> GGUFBlocks:
    """Random codes with small finite float16 scales (a weight's magnitudes), held like a model's table."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    per_row = cols // block_size
    data = rng.integers(0, 256, (rows, per_row, type_size), dtype=np.uint8)
    for at in SCALE_OFFSETS[qtype]:
        scales = rng.standard_normal((rows, per_row, 1)) * 10.0 ** rng.integers(-4, -1, (rows, per_row, 1))
        data[..., at:at + 2] = scales.astype(np.float16).view(np.uint8)
    return GGUFBlocks(qtype, data.reshape(rows, -1), (rows, cols)).resident()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, with -0 and +0 one value."""
    return torch.equal((a.float() + 0.0).view(torch.int32), (b.float() + 0.0).view(torch.int32))


@pytest.mark.parametrize("qtype", CODE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gathered_rows_equal_the_whole_table_dequantized(qtype, dtype):
    blocks = _blocks(qtype, 96, 512)
    whole = blocks.dequantize(dtype)  # the dense table a model without blocks holds
    index = torch.tensor([5, 0, 95, 5, 17, 64, 63])  # repeats and any order, as token ids come
    table = BlockTable(blocks, dtype)
    assert _same_bits(table(index), whole[index])
    assert _same_bits(table[10:40], whole[10:40])
    assert table(index).dtype == dtype and table.nbytes == blocks.data.nbytes < whole.nbytes


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_the_q8_0_fast_path_decodes_every_code_and_scale_as_the_reference(path, monkeypatch):
    """Every int8 code, scales of all magnitudes (subnormal, negative): both decodings of Q8_0 rows (kvcore's
    ``q8_0_rows`` kernel where the kernels are loaded, torch's ops otherwise) are llama.cpp's reference
    dequantization, bit for bit, rounded once to the dtype as torch rounds it."""
    if path == "kernel":
        if kernel_reasons():
            pytest.skip("; ".join(kernel_reasons()))
        load_kernels()
    else:
        monkeypatch.setattr(gguf_blocks, "kernels_loaded", lambda: False)
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, (256, 4, 34), dtype=np.uint8)
    data[:, 0, 2:] = np.arange(256, dtype=np.uint8).reshape(8, 32)[np.arange(256) % 8]  # each code in some row
    scales = rng.standard_normal((256, 4, 1)) * 10.0 ** rng.integers(-7, 3, (256, 4, 1))
    data[..., :2] = scales.astype(np.float16).view(np.uint8)
    blocks = GGUFBlocks(QType.Q8_0, data.reshape(256, -1), (256, 128)).resident()
    reference = torch.from_numpy(gguf.quants.dequantize(blocks.data, QType.Q8_0).reshape(256, 128))
    index = torch.randperm(256)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = blocks.rows(index, dtype)
        assert got.dtype == dtype and got.shape == (256, 128)
        assert _same_bits(got, reference[index].to(dtype)), dtype
    assert _same_bits(blocks.rows(slice(7, 9)), reference[7:9])
    assert blocks.rows(torch.tensor([], dtype=torch.long)).shape == (0, 128)


@pytest.mark.skipif(bool(kernel_reasons()), reason="; ".join(kernel_reasons()))
def test_the_q8_0_kernel_refuses_blocks_of_another_shape():
    load_kernels()
    with pytest.raises(RuntimeError, match="q8_0_rows: blocks must be contiguous uint8"):
        torch.ops.kvcore.q8_0_rows(torch.zeros(2, 33, dtype=torch.uint8), 32, torch.float32)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.kvcore.q8_0_rows(torch.zeros(2, 34, dtype=torch.uint8), 31, torch.float32)
    with pytest.raises(RuntimeError, match="dtype must be"):
        torch.ops.kvcore.q8_0_rows(torch.zeros(2, 34, dtype=torch.uint8), 32, torch.int32)


def test_dense_is_made_once_and_lets_the_blocks_go():
    blocks = _blocks(QType.Q8_0, 64, 256)
    table = BlockTable(blocks, torch.bfloat16)
    index = torch.tensor([3, 60, 3])
    before = table(index)
    dense = table.dense()
    assert table.blocks is None and table.dense() is dense and table.nbytes == dense.nbytes
    assert torch.equal(table(index), before) and torch.equal(dense, blocks.dequantize(torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q6_K, QType.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("a8", [False, True], ids=["int4", "int4a8"])
def test_int4_head_on_blocks_gives_the_dense_heads_logits(qtype, a8):
    """The int4 copy made from the blocks' rows, the candidates' rows decoded per call: the same logits, bit for
    bit, as the head built on the dense table (rows of estimates, rescored candidates, the untouched tail)."""
    blocks = _blocks(qtype, 2048 + 64, 256, seed=1)
    dense = blocks.dequantize(torch.bfloat16)
    on_dense = RescoredInt4Head(dense, a8=a8)
    on_blocks = RescoredInt4Head(BlockTable(blocks, torch.bfloat16), a8=a8)
    assert on_blocks.nbytes == on_dense.nbytes
    torch.manual_seed(0)
    hidden = torch.randn(3, 256).to(torch.bfloat16)
    got, want = on_blocks(hidden), on_dense(hidden)
    assert torch.equal(got, want)
    assert not torch.equal(got, on_dense.int4(hidden))  # the estimates were rescored


@needs_kernel
def test_candidate_rescoring_writes_each_candidates_exact_logit_only():
    from kvcore.kernels.cpu_kernels import load_kernels

    load_kernels()
    torch.manual_seed(1)
    weight = torch.randn(640, 64).to(torch.bfloat16)
    hidden = torch.randn(2, 64).to(torch.bfloat16)
    est = torch.randn(2, 640).to(torch.bfloat16)
    index = torch.ops.kvcore.top_k_candidates(est, 8)
    assert torch.equal(index.sort(dim=1).values, est.float().topk(8, dim=1).indices.sort(dim=1).values)
    got = torch.ops.kvcore.rescore_candidates(est.clone(), hidden, weight[index.view(-1)].view(2, 8, 64), index)
    assert torch.equal(got, torch.ops.kvcore.rescore_top_k(est.clone(), hidden, weight, 8))
    with pytest.raises(RuntimeError, match="index out of range"):
        torch.ops.kvcore.rescore_candidates(est.clone(), hidden, weight[:16].view(2, 8, 64), index + 640)


@pytest.mark.skipif(bool(quantized_reasons("int4", torch.bfloat16, "cpu")), reason="no int4 kernel here")
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_quantized_model_holds_its_gguf_table_as_blocks_with_the_dense_tables_results(tie):
    """Tied or not, the decoder with its table as Q8_0 blocks computes what it computes with that table
    dequantized (a float tensor, held dense); a float model keeps a dense table."""
    model = make_random_model(vocab_size=320, head_dim=32, tie=tie)
    weights = weights_of(model)
    table = model.embed_tokens.detach().numpy()
    blocks = GGUFBlocks(QType.Q8_0, gguf.quants.quantize(table, QType.Q8_0), table.shape)
    config, name = model.config, "model.embed_tokens.weight"
    held = DecoderModel.from_weights(config, {**weights, name: blocks}, torch.bfloat16, weight_format="int4")
    dense = DecoderModel.from_weights(config, {**weights, name: blocks.dequantize()}, torch.bfloat16,
                                      weight_format="int4")
    assert isinstance(held.embedding, BlockTable) and held.embed_tokens.numel() == 0 and dense.embedding is None
    assert (held.lm_head is held.embed_tokens) == tie and (head_rows(held) is held.embedding) == tie
    ids = torch.tensor([0, 319, 7, 7, 150])
    out = {m: m(ids, torch.arange(len(ids)), full_attention) for m in (held, dense)}
    assert torch.equal(out[held], out[dense])
    assert torch.equal(held.compute_logits(out[held]), dense.compute_logits(out[dense]))  # the dense head
    assert (held.embedding is None) == tie  # a tied table became dense for it; an untied one stays blocks
    floats = DecoderModel.from_weights(config, {**weights, name: blocks}, torch.bfloat16)
    assert floats.embedding is None and floats.embed_tokens.shape == (320, 128)


@needs_kernel
def test_int8_head_runs_q8_0_blocks_as_stored():
    """``lm_head = "int8"`` on a Q8_0 table: the blocks' own codes on the int8-group kernel (llama.cpp's head) score
    the vocabulary, then each row's top 64 are rescored with the decoded rows; the tail keeps the kernel's scores,
    within the activations' int8 rounding of the dense head."""
    from kvcore.kernels.group_quant import Int8GroupLinear
    from kvcore.model.lm_head import Int8Head

    blocks = _blocks(QType.Q8_0, 2048 + 64, 256, seed=2)
    table = BlockTable(blocks, torch.bfloat16)
    head = Int8Head(table)
    torch.manual_seed(0)
    hidden = torch.randn(3, 256).to(torch.bfloat16)
    got = head(hidden, widen=True)
    assert got.dtype == torch.float32 and head(hidden).dtype == torch.bfloat16
    scores = Int8GroupLinear(blocks.codes())(hidden)
    top = scores.float().topk(64, dim=-1).indices
    for r in range(3):  # the candidates: dense dot products, rounded to the model dtype
        want = (hidden[r].float() @ table[top[r]].float().t()).to(torch.bfloat16).float()
        assert torch.allclose(got[r, top[r]], want, rtol=1e-2, atol=1e-2), r
    tail = torch.ones_like(got, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(got[tail], scores.float()[tail])  # outside the top 64: the kernel's own scores
    assert not torch.equal(got, scores.float())  # the candidates were rescored
    dense = hidden.float() @ blocks.dequantize(torch.float32).t()
    assert float((got - dense).norm() / dense.norm()) < 0.01
    assert torch.equal(got.argmax(-1), dense.argmax(-1))


@needs_kernel
def test_int8_head_quantizes_a_dense_head_as_q8_0_does():
    """A dense head becomes Q8_0-style codes: per group of 32, d = max|w| / 127, every weight within half a step."""
    from kvcore.model.lm_head import Int8Head, q8_codes

    torch.manual_seed(0)
    w = torch.randn(64, 96) * 0.05
    w[0, :32] = 0  # an all-zero group
    codes = q8_codes(w)
    assert codes.bits == 8 and codes.group_size == 32
    step = codes.d.repeat_interleave(32, dim=1)
    assert bool(((codes.dequantize() - w).abs() <= step / 2 + 1e-7).all())
    hidden = torch.randn(2, 96).to(torch.bfloat16)
    dense = hidden.float() @ w.t()
    got = Int8Head(w.to(torch.bfloat16))(hidden, widen=True)
    assert float((got - dense).norm() / dense.norm()) < 0.02


@needs_kernel
def test_the_engine_builds_the_int8_head_in_float32_and_bfloat16_not_float16():
    from helpers import make_random_model

    from kvcore import Engine, EngineConfig, SamplingParams
    from kvcore.errors import ConfigError
    from kvcore.model.lm_head import Int8Head

    model = make_random_model(vocab_size=320, dtype=torch.bfloat16)  # hidden 64: whole groups of 32
    engine = Engine(model, None, EngineConfig(dtype="bfloat16", lm_head="int8"))
    assert isinstance(engine.lm_head, Int8Head)
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    fp32 = make_random_model(vocab_size=320)
    head = Engine(fp32, None, EngineConfig(dtype="float32", lm_head="int8")).lm_head
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    logits, exact = head(hidden), hidden @ fp32.lm_head.t()
    assert logits.dtype == torch.float32 and torch.equal(logits.argmax(-1), exact.argmax(-1))
    best = exact.argmax(-1, keepdim=True)  # rescored: the dense head's float32 logit, to float32 rounding
    torch.testing.assert_close(logits.gather(1, best), exact.gather(1, best))
    with pytest.raises(ConfigError, match="lm_head 'int8' cannot run here: .*need dtype float32 or bfloat16"):
        EngineConfig(dtype="float16", lm_head="int8")
