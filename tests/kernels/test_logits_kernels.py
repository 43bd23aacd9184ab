"""The passes over a decode step's logits as kvcore operators (csrc/logits.cpp, csrc/rescore_top_k.cpp's float32
forms): each returns exactly what the ATen ops it replaces return."""

from __future__ import annotations

import pytest
import torch

from kvcore.kernels.cpu_kernels import kernel_reasons, load_kernels
from kvcore.model.lm_head import RescoredInt4Head

pytestmark = pytest.mark.skipif(bool(kernel_reasons()), reason="; ".join(kernel_reasons()))


@pytest.fixture(autouse=True)
def _kernels():
    load_kernels()


def _hard_rows(vocab: int) -> torch.Tensor:
    """Rows where a sloppy argmax goes wrong: ties across and inside chunks, all -inf, NaN before and after the
    maximum, +inf, the maximum in the tail after the last whole chunk, at index 0 and at the last index."""
    torch.manual_seed(3)
    x = torch.randn(12, vocab)
    x[1, vocab - 7] = x[1, 70 % vocab] = 50.0
    x[2, 10] = x[2, 11] = 50.0
    x[3] = float("-inf")
    x[4, vocab // 2] = float("nan")
    x[5, 5], x[5, vocab - 3] = float("inf"), float("nan")
    x[6, vocab - 1] = float("inf")
    x[7, vocab - 2] = 60.0  # in the tail when vocab is not a multiple of the chunk
    x[8, 0] = 60.0
    x[9, 3], x[9, 900 % vocab] = float("nan"), float("nan")
    x[10] = 1.0  # every logit equal
    x[11, 1] = float("-inf")
    return x


@pytest.mark.parametrize("vocab", [1, 5, 64, 1000, 1024, 49152 + 13])
def test_argmax_rows_is_torch_argmax(vocab):
    from kvcore.sampling.processors import argmax_rows

    x = _hard_rows(vocab) if vocab >= 16 else torch.randn(3, vocab)
    got = torch.ops.kvcore.argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(-1))
    assert torch.equal(argmax_rows(x), x.argmax(-1))  # the sampler's function takes the operator here
    if vocab == 1000:
        assert got.tolist()[1:11] == [70, 10, 0, 500, 997, 999, 998, 0, 3, 0]


def test_argmax_rows_refuses_what_it_does_not_read():
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.kvcore.argmax_rows(torch.randn(2, 64).bfloat16())
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.kvcore.argmax_rows(torch.randn(64, 2).t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_all_finite_finds_one_non_finite_value_anywhere(dtype, bad):
    big = torch.finfo(dtype).max
    a, b = torch.full((3, 37), big, dtype=dtype), torch.randn(1, 1000).to(dtype)
    assert torch.ops.kvcore.all_finite([a, b])  # finite values whose sum overflows
    for where in (0, 16, 500, 999):  # vector lanes, and the scalar tail
        spoiled = b.clone()
        spoiled[0, where] = bad
        assert not torch.ops.kvcore.all_finite([a, spoiled])
        assert not torch.ops.kvcore.all_finite([spoiled.t(), a])  # any layout
    assert torch.ops.kvcore.all_finite([torch.empty(0, dtype=dtype), a])


@pytest.mark.parametrize("blocks", [False, True], ids=["dense-head", "candidates"])
def test_the_float32_head_is_the_bfloat16_head_widened_bit_for_bit(blocks):
    torch.manual_seed(2)
    weight = torch.randn(640, 64).to(torch.bfloat16)
    hidden = torch.randn(3, 64).to(torch.bfloat16)
    est = torch.randn(3, 640).to(torch.bfloat16)
    est[1, 7] = float("nan")  # never a candidate; widened as it is
    if blocks:
        index = torch.ops.kvcore.top_k_candidates(est, 8)
        rows = weight[index.view(-1)].view(3, 8, 64)
        want = torch.ops.kvcore.rescore_candidates(est.clone(), hidden, rows, index).float()
        got = torch.ops.kvcore.rescore_candidates_float(est, hidden, rows, index)
    else:
        want = torch.ops.kvcore.rescore_top_k(est.clone(), hidden, weight, 8).float()
        got = torch.ops.kvcore.rescore_top_k_float(est, hidden, weight, 8)
    assert got.dtype == torch.float32 and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert not torch.equal(got.nan_to_num(), est.float().nan_to_num())  # the candidates were rescored


def test_compute_logits_takes_the_widened_head_unless_a_soft_cap_follows():
    import dataclasses

    from helpers import make_random_model

    model = make_random_model(dtype=torch.bfloat16, vocab_size=320)
    head = RescoredInt4Head(model.lm_head)
    hidden = torch.randn(2, model.config.hidden_size).to(torch.bfloat16)
    assert torch.equal(model.compute_logits(hidden, head), head(hidden).float())
    model.config = dataclasses.replace(model.config, final_logit_softcapping=30.0)
    capped = head(hidden)  # the cap in the model dtype, as before, then widened
    assert torch.equal(model.compute_logits(hidden, head), (torch.tanh(capped / 30.0) * 30.0).float())
