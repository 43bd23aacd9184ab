"""What a loaded model and its KV pool hold in memory (docs/performance.md, "Memory"): each weight once, in its
run-time form; GGUF tensors read one at a time from the file; cache pools resident only where written."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from helpers import full_attention

from kvcore.interfaces.kv_cache import CacheSpec, zeros
from kvcore.kernels.cpu_kernels import int4a8_reasons
from kvcore.kernels.linear import DenseMatmuls
from kvcore.kernels.quant import Int4A8Linear, Int4Groups
from kvcore.loaders.gguf_blocks import GGUFBlocks
from kvcore.model.lm_head import int4a8_in_chunks


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor an object (a quantized linear, a DenseLinear) keeps as an attribute."""
    names = list(getattr(obj, "__dict__", {})) + list(getattr(type(obj), "__slots__", ()))
    return [v for v in (getattr(obj, n, None) for n in names) if isinstance(v, torch.Tensor)]


def _q8_0(rows: int, cols: int, seed: int = 0) -> GGUFBlocks:
    rng = np.random.default_rng(seed)
    n = rows * cols // 32
    d = (rng.random(n, dtype=np.float32) * 0.01 + 1e-3).astype(np.float16).view(np.uint8).reshape(n, 2)
    q = rng.integers(0, 256, (n, 32), dtype=np.uint8)
    return GGUFBlocks(QType.Q8_0, np.concatenate([d, q], axis=1).reshape(rows, -1), (rows, cols))


def test_blocks_dequantize_in_chunks_as_the_reference_does():
    blocks = _q8_0(4096 + 70, 64)  # past one chunk of rows
    reference = torch.from_numpy(gguf.quants.dequantize(blocks.data, QType.Q8_0).reshape(blocks.shape))
    assert torch.equal(blocks.dequantize(), reference)
    assert torch.equal(blocks.dequantize(torch.bfloat16), reference.to(torch.bfloat16))  # rounded once
    column_major = torch.empty(blocks.shape[::-1], dtype=torch.bfloat16).t()
    blocks.dequantize_into(column_major)
    assert torch.equal(column_major, reference.to(torch.bfloat16))
    assert blocks.is_finite()


def test_blocks_given_as_a_reader_read_on_each_use():
    stored = _q8_0(64, 64).data
    reads = []

    def read():
        reads.append(1)
        return stored.reshape(-1)

    blocks = GGUFBlocks(QType.Q8_0, read, (64, 64))
    first, second = blocks.split([48, 16])
    assert not reads  # nothing read until a value is needed
    assert np.array_equal(second.data, stored[48:]) and len(reads) == 1
    assert np.array_equal(first.map_rows(lambda rows: rows[::-1]).data, stored[:48][::-1])


def test_int4_quantization_in_row_chunks_matches_each_row_alone():
    torch.manual_seed(0)
    w = torch.randn(1024 + 48, 64)
    whole = Int4Groups.from_float(w, 32)
    for rows in (slice(0, 16), slice(1008, 1040), slice(1024, 1072)):  # inside, across and after a chunk boundary
        alone = Int4Groups.from_float(w[rows], 32)
        for field in ("q", "scales", "zeros"):
            assert torch.equal(getattr(whole, field)[rows], getattr(alone, field))


def test_float32_matmuls_keep_one_copy_of_the_weights():
    weights = [torch.randn(1024, 512).t().contiguous().t() for _ in range(2)]  # big, column-major
    mm = DenseMatmuls()
    for rows in (1, 8, 300):  # decode and prefill sizes
        built = mm.get({"w": weights}, rows)["w"]
        held = [t for linear in built for t in _tensors(linear)]
        assert all(any(t is w for w in weights) for t in held), f"{rows} rows: a second copy of a float32 weight"


def test_cache_storage_is_resident_only_where_written():
    before = _rss_bytes()
    pool = zeros((64, 1 << 20), torch.bfloat16, "cpu")  # 128 MiB reserved
    assert _rss_bytes() - before < 16 << 20
    assert pool.shape == (64, 1 << 20) and not bool(pool[::7, ::4099].any())  # reads as zeros
    pool[3].fill_(1.5)
    assert float(pool[3].float().sum()) == 1.5 * (1 << 20) and _rss_bytes() - before < 24 << 20


def test_a_cache_sized_for_many_long_sequences_costs_only_what_it_holds():
    from kvcore.backends.paged import PagedKVCache

    spec = CacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32, device=torch.device("cpu"),
                     max_num_seqs=64, max_seq_len=4096, block_size=16)
    before = _rss_bytes()
    cache = PagedKVCache(spec)
    assert cache.k_pool.nbytes + cache.v_pool.nbytes == 2 * 4 * 64 * 4096 * 2 * 64 * 4  # 1 GiB reserved
    assert _rss_bytes() - before < 32 << 20


@pytest.mark.slow
def test_a_new_float32_model_allocates_its_column_major_weights_without_writing_them(monkeypatch):
    """Float32 matmul weights are stored column-major; a new model's, not written yet, are allocated so rather than
    copied into that order: a quantized model then drops them, and the copy wrote every page of the dense weights
    first (several GB at 1.7B; an 8B file's start was killed for memory)."""
    from helpers import make_random_model

    import kvcore.kernels.linear
    from kvcore import LlamaModel

    monkeypatch.setattr(kvcore.kernels.linear, "COLUMN_MAJOR_MIN_NUMEL", 1)  # the tiny weights count as big
    copied, contiguous = [], torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda t, *a, **k: copied.append(t.shape) or contiguous(t, *a, **k))
    model = LlamaModel(make_random_model().config, torch.float32)
    weights = [p for plist in (model.qkv_proj, model.o_proj, model.gate_up_proj, model.down_proj) for p in plist]
    assert all(p.stride() == (1, p.shape[0]) for p in [*weights, model.lm_head])
    assert copied == []


def test_a_quantized_gguf_model_holds_each_weight_once_in_its_packed_form():
    from kvcore.loaders import build_model, load_model
    from kvcore.loaders.gguf_validate import validate_gguf
    from kvcore.loaders.resolve import smollm2_path

    path = smollm2_path()
    loaded = load_model("smollm2", keep_quantized=True)
    with open("/proc/self/maps") as f:
        assert str(path.resolve()) not in f.read()  # the loader left no mapping of the file behind
    matrices = {n: w for n, w in loaded.weights.items() if len(w.shape) == 2}
    assert matrices and all(isinstance(w, GGUFBlocks) for w in matrices.values())  # not read until built
    model = build_model(loaded, torch.bfloat16, weights="int4a8")

    layout = validate_gguf(path)
    stored = {t.name: t for t in layout.tensors if len(t.dims) == 2}  # Q4_1 layer matrices, the Q8_0 table
    packed = sum(t.nbytes for t in stored.values())
    dense = sum(int(np.prod(t.dims)) * 2 for t in layout.tensors if t.name not in stored)  # norms in bfloat16
    params = {id(p): p for p in model.parameters()}.values()
    linears = [lin for lists in model._quantized.values() for lin in lists]
    held = sum(p.nbytes for p in params) + sum(t.nbytes for lin in linears for t in _tensors(lin))
    # int4a8 codes and scales are the Q4_1 bytes; the rest in bfloat16, once; the tied table's Q8_0 blocks stay in
    # the file (rows read per lookup), not in memory
    table = stored["token_embd.weight"].nbytes
    assert model.embedding.blocks.in_file and model.embedding.nbytes == table
    assert held == packed - table + dense
    assert model.embed_tokens.numel() == 0 and model.lm_head is model.embed_tokens
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert all(p.numel() == 0 for p in getattr(model, name))  # no dense copy beside the packed one


@pytest.mark.skipif(bool(int4a8_reasons()), reason="; ".join(int4a8_reasons()))
def test_int4a8_built_in_row_chunks_equals_the_whole_weight_packed_at_once():
    torch.manual_seed(0)
    w = torch.randn(4096 + 96, 64).to(torch.bfloat16)
    whole = Int4A8Linear(Int4Groups.from_float(w, 32), torch.bfloat16)
    chunked = int4a8_in_chunks(w, rows=1024)
    assert chunked.shape == whole.shape
    assert torch.equal(chunked.codes, whole.codes) and torch.equal(chunked.dm, whole.dm)


@pytest.mark.slow
@pytest.mark.skipif(bool(int4a8_reasons()), reason="; ".join(int4a8_reasons()))
def test_a_table_held_as_blocks_gives_the_dense_tables_logits(smollm2_blocks_and_dense):
    """SmolLM2's tied Q8_0 table: held as blocks (rows decoded per lookup, the int4 head's candidates from the
    same blocks) or dequantized whole, the model computes the same logits bit for bit; a dense head call (more
    rows than the int4 head takes) turns the blocks into the dense table, once."""
    from kvcore.model.embedding import head_rows
    from kvcore.model.lm_head import A8_MAX_ROWS, RescoredInt4Head

    held, dense = smollm2_blocks_and_dense
    assert held.embedding is not None and dense.embedding is None
    heads = {m: RescoredInt4Head(head_rows(m), a8=True) for m in (held, dense)}
    ids = torch.tensor([1, 9690, 314, 253, 1345, 563, 253, 39485, 30])
    out = {m: m(ids, torch.arange(len(ids)), full_attention) for m in (held, dense)}
    assert torch.equal(out[held], out[dense])
    last = {m: m.compute_logits(out[m][-1:], heads[m]) for m in (held, dense)}
    assert torch.equal(last[held], last[dense])
    many = torch.cat([out[held]] * 2)[: A8_MAX_ROWS + 1]  # past the int4 head: the dense head
    assert torch.equal(held.compute_logits(many, heads[held]), dense.compute_logits(many, heads[dense]))
    assert held.embedding is None and held.embed_tokens.shape == dense.embed_tokens.shape  # dense now, once
    assert heads[held].weight.dense().data_ptr() == held.embed_tokens.data_ptr()
    assert torch.equal(held.compute_logits(out[held][-1:], heads[held]), last[dense])


@pytest.fixture
def smollm2_blocks_and_dense():
    from kvcore.loaders import build_model, load_model

    loaded = load_model("smollm2", keep_quantized=True)
    held = build_model(loaded, torch.bfloat16, max_model_len=64, weights="int4a8")
    name = "model.embed_tokens.weight"
    loaded.weights[name] = loaded.weights[name].dequantize()  # a float32 table: the dense path
    return held, build_model(loaded, torch.bfloat16, max_model_len=64, weights="int4a8")
