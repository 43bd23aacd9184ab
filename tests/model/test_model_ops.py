"""The decoder's fused small ops give bitwise the values of Hugging Face's spelled-out formulas."""

from __future__ import annotations

import pytest
import torch

from kvcore.model.layers import rms_norm


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 576), (7, 576), (300, 64), (5, 3, 64), (2, 4, 100)])
def test_rms_norm_is_bitwise_hf(dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 4).to(dtype)
    weight = (1 + 0.3 * torch.randn(shape[-1], generator=gen)).to(dtype)
    for eps in (1e-5, 1e-6):
        got = rms_norm(x, weight, eps)
        assert got.dtype == dtype and torch.equal(got, hf_rms_norm(x, weight, eps))


def test_rms_norm_float32_weight_on_narrow_input():
    x = torch.randn(3, 64).bfloat16()
    weight = torch.randn(64)
    got = rms_norm(x, weight, 1e-5)
    assert got.dtype == torch.float32 and torch.equal(got, hf_rms_norm(x, weight, 1e-5))
