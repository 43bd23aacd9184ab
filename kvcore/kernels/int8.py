"""The ``int8`` weight format: weight-only int8 with one symmetric scale per output row, on torch's CPU kernel
(``aten._weight_int8pack_mm``)."""

from __future__ import annotations

import torch

__all__ = ["Int8Linear"]


class Int8Linear:
    """``y = x @ W.T`` with ``W = q * s``: int8 codes ``[N, K]``, one scale per output row (symmetric)."""

    format = "int8"

    def __init__(self, w: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> None:
        n, k = w.shape
        if not self.fits(n, k):
            raise ValueError(f"int8 kernel cannot take a [{n}, {k}] weight")
        w = w.detach().float()
        self.scales = (w.abs().amax(1) / 127).clamp(min=1e-12).to(dtype)  # [N], as the kernel reads them
        self.q = (w / self.scales.float()[:, None]).round_().clamp_(-127, 127).to(torch.int8).contiguous()
        self.shape, self.dtype = (n, k), dtype

    @staticmethod
    def fits(n: int, k: int) -> bool:
        """Input widths in multiples of 32 (others read out of bounds in torch 2.13's CPU kernel)."""
        return k % 32 == 0

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, K]`` in ``self.dtype`` -> ``[T, N]``."""
        return torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.q, self.scales)

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` float32 (scales as the kernel reads them)."""
        return self.q.float() * self.scales.float()[:, None]
