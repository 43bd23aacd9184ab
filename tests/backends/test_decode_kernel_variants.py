"""The C++ decode kernel's sliding window and soft-cap (kvcore/kernels/csrc/decode_attention.cpp) against
``explicit_attention``: ragged rows, split-K chunks crossed by the window edge, window 1, float32 and
bfloat16."""

from __future__ import annotations

import pytest
import torch

from kvcore.backends.cpu_decode import CPUDecodeBackend
from kvcore.interfaces.attention import explicit_attention
from kvcore.interfaces.layer_attention import LayerAttention

pytestmark = pytest.mark.skipif(CPUDecodeBackend.availability() is not None, reason="no C++ toolchain here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, softcap", [(None, 2.0), (300, None), (1, None), (77, 1.5), (5000, 30.0)])
def test_decode_kernel_window_and_softcap(dtype, window, softcap):
    from kvcore.kernels.cpu_kernels import load_kernels

    load_kernels()
    gen = torch.Generator().manual_seed(0)
    lens = [1700, 301, 1, 900]  # long rows split into chunks, a row shorter than the window, one key
    b, h_kv, g, d, max_len = len(lens), 2, 4, 64, 1800
    q = torch.randn(b, h_kv, g, d, generator=gen).to(dtype)
    k = torch.randn(b, h_kv, max_len, d, generator=gen).to(dtype)
    v = torch.randn(b, h_kv, max_len, d, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    layer = LayerAttention(d**-0.5 * 2, sliding_window=window, softcap=softcap)  # scores O(2): the cap bites
    got = torch.ops.kvcore.decode_attention(q, k, v, seq_lens, layer.scale, window or 0, softcap or 0.0)
    keys = torch.arange(max_len)[None, :]
    visible = keys < seq_lens[:, None].long()
    if window is not None:
        visible &= keys >= seq_lens[:, None].long() - window
    want = explicit_attention(q.float().reshape(b, h_kv * g, 1, d), k.float(), v.float(), visible[:, None, None, :],
                              layer).view(b, h_kv, g, d)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    if (window is not None and window < 1700) or (softcap or 99) < 10:  # where the variant changes the answer
        plain = torch.ops.kvcore.decode_attention(q, k, v, seq_lens, layer.scale)
        assert (plain.float() - want).abs().max() > 10 * tol
