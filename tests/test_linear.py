"""The decoder's CPU matmul helpers (kvcore/linear.py)."""

import pytest
import torch
import torch.nn.functional as F

from kvcore.linear import linear as kv_linear
from kvcore.linear import prepack, row_bucket


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
