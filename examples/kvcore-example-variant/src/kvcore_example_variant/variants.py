"""Two attention variants written as code: each ``bind`` returns one layer's FlexAttention-style functions."""

import torch

from kvcore.interfaces.variants import AttentionVariant, BoundVariant


class Alibi(AttentionVariant):
    """ALiBi (Press et al.): ``score + slope_h · (kv_idx − q_idx)``, slopes ``2^(−max_bias · (h+1) / H)``."""

    name = "alibi"
    description = "ALiBi: a linear penalty on distance, one slope per head"

    def __init__(self, max_bias: float = 8.0) -> None:
        self.max_bias = max_bias

    def bind(self, shape):
        slopes = 2.0 ** (-self.max_bias * torch.arange(1, shape.num_heads + 1) / shape.num_heads)  # [H]
        return BoundVariant(self.name, score_mod=lambda s, b, h, q, kv: s + slopes.to(s.device)[h] * (kv - q))


class LocalGlobal(AttentionVariant):
    """Gemma 3's pattern: ``window`` tokens on every layer but each ``period``-th, which attends globally."""

    name = "local_global"
    description = "sliding-window layers, every period-th one global"

    def __init__(self, window: int = 8, period: int = 2) -> None:
        self.window, self.period = window, period

    def bind(self, shape):
        if (shape.layer_idx + 1) % self.period == 0:
            return None  # a global layer: plain causal attention
        return BoundVariant(self.name, mask_mod=lambda b, h, q, kv: q - kv < self.window)
