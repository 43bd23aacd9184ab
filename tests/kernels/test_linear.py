"""The decoder's CPU matmul helpers (kvcore/kernels/linear.py)."""

import pytest
import torch
import torch.nn.functional as F

from kvcore.kernels.linear import linear as kv_linear
from kvcore.kernels.linear import prepack, row_bucket


def test_row_buckets_pad_little_and_stay_few():
    buckets = {row_bucket(m) for m in range(1, 4097)}
    assert row_bucket(1) == 1 and row_bucket(3) == 4 and row_bucket(16) == 16 and row_bucket(17) == 18
    for m in range(1, 4097):
        b = row_bucket(m)
        assert b >= m and row_bucket(b) == b  # padding is idempotent: a bucket maps to itself
        assert m <= 16 or b <= m * 1.125
    assert len(buckets) <= 8 * 12  # at most 8 shapes per octave: bounded per-shape state in oneDNN


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("rows", [2, 3, 17, 100, 257])
def test_prepacked_linear_returns_exactly_the_rows_it_was_given(rows):
    torch.manual_seed(0)
    w = torch.randn(640, 256)  # big enough to be prepacked
    packed = prepack(w)
    assert packed is not None
    x = torch.randn(rows, 256)
    out = kv_linear(x, w, packed)
    assert out.shape == (rows, 640) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4)


def _bf16_kernel_or_skip():
    from kvcore.kernels.cpu_kernels import bf16_linear_ready

    if not bf16_linear_ready():
        pytest.skip("kvcore's bf16_linear kernel needs a CPU with AVX512_BF16 and a C++ compiler")


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40, 130])
def test_bf16_kernel_matches_float64_within_one_rounding(rows):
    """kvcore's bf16_linear (decode steps of dense bfloat16 models): float32 sums of the bfloat16 products,
    rounded once, at one tile (up to 16 rows) and in tiles of up to 16 (17 = 9 + 8, 130 = 9 x ~15)."""
    _bf16_kernel_or_skip()
    from kvcore.kernels.linear import Bf16Linear, pack_bf16

    g = torch.Generator().manual_seed(rows)
    w = torch.randn(1040, 288, generator=g).to(torch.bfloat16)  # 65 blocks of 16 rows, 9 groups of 32 columns
    x = torch.randn(rows, 288, generator=g).to(torch.bfloat16)
    out = Bf16Linear(w, pack_bf16(w))(x)
    exact = x.double() @ w.double().t()
    assert out.shape == (rows, 1040) and out.dtype == torch.bfloat16
    # one bfloat16 rounding of the result, plus float32 summation of 288 products
    bound = 2.0**-8 * exact.abs() + 1e-5 * (x.double().abs() @ w.double().abs().t())
    assert bool(((out.double() - exact).abs() <= bound).all())


def test_bf16_kernel_rows_do_not_depend_on_their_batch():
    """Each row is computed on its own: a token's projections are the same bits in a decode step of one, in a
    batch of 8 and inside a 40-row prefill (so decode and prefill of the same row agree)."""
    _bf16_kernel_or_skip()
    from kvcore.kernels.linear import Bf16Linear, pack_bf16

    g = torch.Generator().manual_seed(1)
    w = torch.randn(512, 576, generator=g).to(torch.bfloat16)
    lin = Bf16Linear(w, pack_bf16(w))
    x = torch.randn(40, 576, generator=g).to(torch.bfloat16)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(40)])
    assert torch.equal(lin(x[:8]), alone[:8])
    assert torch.equal(lin(x), alone)


def test_bf16_kernel_shapes_and_dense_matmul_modes(monkeypatch):
    """Weights the kernel cannot take (output rows not in 16s, input columns not in 32s, small ones) stay on
    F.linear; a bfloat16 forward of up to BF16_KERNEL_MAX_ROWS rows runs the kernel, beyond that F.linear (on a
    CPU without AMX: the AMX limit has its own test below, so this one holds on either kind of CPU)."""
    _bf16_kernel_or_skip()
    import types

    import kvcore.kernels.linear
    from kvcore.kernels.linear import BF16_KERNEL_MAX_ROWS, Bf16Linear, DenseLinear, DenseMatmuls, pack_bf16

    no_amx = types.SimpleNamespace(amx=False, bf16_matmul=True)
    monkeypatch.setattr(kvcore.kernels.linear, "cpu_features", lambda: no_amx)

    assert pack_bf16(torch.zeros(1000, 576, dtype=torch.bfloat16)) is None  # 1000 rows: not in blocks of 16
    assert pack_bf16(torch.zeros(1024, 600, dtype=torch.bfloat16)) is None  # 600 columns: not in 32s
    assert pack_bf16(torch.zeros(64, 64, dtype=torch.bfloat16)) is None  # small: cache-resident, plain F.linear
    big = torch.zeros(1024, 576, dtype=torch.bfloat16)
    odd = torch.zeros(1000, 576, dtype=torch.bfloat16)
    mm = DenseMatmuls()
    built = mm.get({"a": [big, odd]}, BF16_KERNEL_MAX_ROWS)
    assert isinstance(built["a"][0], Bf16Linear) and type(built["a"][1]) is DenseLinear
    assert built["a"][1].packed is None
    assert mm.mode(big, BF16_KERNEL_MAX_ROWS + 1, True) == "plain"
    assert mm.mode(big, 1, use_packed=False) == "plain"
    bf16 = torch.bfloat16
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        torch.ops.kvcore.bf16_linear(torch.zeros(2, 48, dtype=bf16), torch.zeros(1, 24, 16, 2, dtype=bf16))
    with pytest.raises(RuntimeError, match="packed must be"):
        torch.ops.kvcore.bf16_linear(torch.zeros(2, 64, dtype=bf16), torch.zeros(1, 16, 16, 2, dtype=bf16))


def test_bf16_kernel_keeps_to_decode_batches_on_amx_cpus(monkeypatch):
    """Where the CPU has AMX (oneDNN multiplies bfloat16 tiles there), only up to 16 rows take the kernel."""
    _bf16_kernel_or_skip()
    import types

    import kvcore.kernels.linear
    from kvcore.kernels.linear import BF16_KERNEL_MAX_ROWS_AMX, DenseMatmuls

    big = torch.zeros(1024, 576, dtype=torch.bfloat16)
    amx = types.SimpleNamespace(amx=True, bf16_matmul=True)
    monkeypatch.setattr(kvcore.kernels.linear, "cpu_features", lambda: amx)
    mm = DenseMatmuls()
    assert mm.mode(big, BF16_KERNEL_MAX_ROWS_AMX, True) == "kernel"
    assert mm.mode(big, BF16_KERNEL_MAX_ROWS_AMX + 1, True) == "plain"
