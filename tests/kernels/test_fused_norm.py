"""kvcore's fused residual add + RMSNorm (csrc/rms_norm.cpp, model.layers.add_rms_norm) against the eager ops."""

from __future__ import annotations

import pytest
import torch
from helpers import full_attention, make_random_model, weights_of

from kvcore import LlamaModel
from kvcore.kernels.cpu_kernels import int4a8_reasons, kernel_reasons, load_kernels
from kvcore.model.layers import add_rms_norm

pytestmark = pytest.mark.skipif(bool(kernel_reasons()), reason="; ".join(kernel_reasons()))

#: one bfloat16 step at the values compared (|x| < 8): 2^-7 relative, so 2^-4 absolute at most
ONE_STEP = 2.0 ** -4


@pytest.mark.parametrize("rows", [1, 33])  # a decode row; a prefill's rows in parallel
@pytest.mark.parametrize("with_delta", [True, False])
def test_kernel_equals_the_eager_add_and_norm(rows, with_delta):
    load_kernels()
    gen = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 576, generator=gen).bfloat16()
    delta = torch.randn(rows, 576, generator=gen).bfloat16() if with_delta else None
    weight = (1 + torch.randn(576, generator=gen) / 4).bfloat16()
    h_eager, h_fused = h.clone(), h.clone()
    eager = add_rms_norm(h_eager, delta, weight, 1e-5, fused=False)
    fused = add_rms_norm(h_fused, delta, weight, 1e-5, fused=True)
    assert torch.equal(h_fused, h_eager)  # the residual: the same bfloat16 sums
    assert fused.dtype == torch.bfloat16 and fused.shape == eager.shape
    diff = (fused.float() - eager.float()).abs()
    assert float(diff.max()) <= ONE_STEP * float(eager.float().abs().max()) / 4
    assert float((diff == 0).float().mean()) >= 0.99  # only rounding boundaries differ


@pytest.mark.skipif(bool(int4a8_reasons()), reason="; ".join(int4a8_reasons()))
def test_int4a8_models_use_it_and_decode_like_the_eager_ops(monkeypatch):
    """An int4a8 model's forward goes through the kernel (and only an int4a8 model's), with logits within a
    bfloat16 rounding's effect of the eager ops' and the same greedy tokens."""
    base = make_random_model(num_layers=2)
    model = LlamaModel.from_weights(base.config, weights_of(base), torch.bfloat16, weight_format="int4a8")
    int4 = LlamaModel.from_weights(base.config, weights_of(base), torch.bfloat16, weight_format="int4")
    assert model.fused_norm and not int4.fused_norm and not base.fused_norm
    model.fused_layers = False  # the eager layers, whose norms this counts (test_fused_layer.py: fused ones)
    ids, pos = torch.tensor([5, 9, 200, 31, 7, 8, 120, 3]), torch.arange(8)
    calls = []
    kernel = torch.ops.kvcore.rms_norm

    def counting(*args):
        calls.append(args[1] is not None)
        return kernel(*args)

    monkeypatch.setattr(torch.ops.kvcore, "rms_norm", counting)
    fused = model.compute_logits(model(ids, pos, full_attention))
    layers = base.config.num_hidden_layers
    assert calls == [False] + [True] * (2 * layers)  # input norm of layer 0, then every add + norm
    model.fused_norm = False
    eager = model.compute_logits(model(ids, pos, full_attention))
    assert len(calls) == 1 + 2 * layers  # not called again
    scale = float(eager.abs().max())
    assert float((fused - eager).abs().max()) <= 0.05 * scale
    assert int((fused.argmax(-1) == eager.argmax(-1)).sum()) >= 7
