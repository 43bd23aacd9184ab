"""Rotary position embeddings: one implementation, parameterised by the scaling schemes checkpoints declare.

A scheme only changes the per-dimension inverse frequencies ``inv_freq [D/2]`` and a factor applied to
``cos``/``sin`` (YaRN's and LongRoPE's attention factor); the rotation itself is always the "rotate half"
layout of Hugging Face (dims ``[0, D/2)`` pair with ``[D/2, D)``). :func:`inv_freq_and_factor` follows
transformers' ``ROPE_INIT_FUNCTIONS`` (tests/model/test_rope.py checks every scheme against them).

Schemes whose frequencies depend on the sequence length (``dynamic`` NTK, ``longrope``'s short/long
factors) are evaluated once, for the longest sequence the tables serve (the engine's ``max_model_len``):
a KV cache keeps keys rotated at the time they were written, so the frequencies must not change while a
sequence grows. transformers re-evaluates them per forward call from the batch's longest position, so the
two agree whenever that table length is at most the model's original context length (``dynamic`` is then
plain RoPE, ``longrope`` uses its short factors) and differ for sequences shorter than a longer table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kvcore.errors import ModelLoadError

__all__ = ["RopeScaling", "ROPE_TYPES", "inv_freq_and_factor", "RotaryEmbedding"]

#: the schemes :class:`RopeScaling` accepts ("default" = plain RoPE)
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """A checkpoint's RoPE scaling (Hugging Face ``rope_scaling`` / ``rope_parameters``, without the theta).

    ``factor`` applies to linear, dynamic, llama3 and yarn; ``original_max_position_embeddings`` to
    llama3, yarn and longrope (and the ``max_position_embeddings`` of the config is the scaled window).
    ``freq_factors`` divides each inverse frequency (llama.cpp's ``rope_freqs`` tensor, which is how GGUF
    stores Llama 3.1's scaling).
    """

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn (DeepSeek style attention factor)
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    attention_factor: float | None = None  # yarn / longrope: None = derived from factor
    short_factor: tuple[float, ...] | None = None  # longrope, [D/2]
    long_factor: tuple[float, ...] | None = None  # longrope, [D/2]
    freq_factors: tuple[float, ...] | None = None  # [D/2] divisors (GGUF rope_freqs)

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ModelLoadError(
                f"unsupported RoPE scaling '{self.rope_type}' (supported: {', '.join(ROPE_TYPES)})"
            )
        needs_original = self.rope_type in ("llama3", "yarn", "longrope")
        if needs_original and not self.original_max_position_embeddings:
            raise ModelLoadError(f"RoPE scaling '{self.rope_type}' needs original_max_position_embeddings")
        if self.rope_type == "longrope" and (self.short_factor is None or self.long_factor is None):
            raise ModelLoadError("RoPE scaling 'longrope' needs short_factor and long_factor")
        if self.rope_type in ("linear", "dynamic", "llama3") and not self.factor > 0:
            raise ModelLoadError(f"RoPE scaling '{self.rope_type}' needs a positive factor, got {self.factor!r}")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_factor(
    head_dim: int, theta: float, scaling: RopeScaling | None, max_position_embeddings: int, seq_len: int
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim/2] float32, attention factor)`` of a scheme, for sequences up to ``seq_len``.

    :param max_position_embeddings: the config's (scaled) context window.
    :param seq_len: the longest sequence the tables serve (only ``dynamic`` and ``longrope`` read it).
    """
    s = scaling or RopeScaling()
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [D/2]
    base_inv = 1.0 / (theta**exponents)
    factor = 1.0
    kind = s.rope_type
    if kind == "default":
        inv = base_inv
    elif kind == "linear":
        inv = base_inv / s.factor
    elif kind == "dynamic":
        length = max(seq_len, max_position_embeddings)
        base = theta * ((s.factor * length / max_position_embeddings) - (s.factor - 1)) ** (dim / (dim - 2))
        inv = 1.0 / (base**exponents)
    elif kind == "llama3":
        old = s.original_max_position_embeddings
        low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
        wavelen = 2 * math.pi / base_inv
        inv = torch.where(wavelen > low_wavelen, base_inv / s.factor, base_inv)
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * inv / s.factor + smooth * inv
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, inv)
    elif kind == "yarn":
        inv, factor = _yarn(dim, theta, s, max_position_embeddings)
    else:  # longrope
        inv, factor = _longrope(dim, theta, s, max_position_embeddings, seq_len)
    if s.freq_factors is not None:
        if len(s.freq_factors) != dim // 2:
            raise ModelLoadError(f"RoPE frequency factors have {len(s.freq_factors)} entries, expected {dim // 2}")
        inv = inv / torch.tensor(s.freq_factors, dtype=torch.float32)
    return inv.float(), float(factor)


def _yarn(dim: int, theta: float, s: RopeScaling, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    original = s.original_max_position_embeddings
    factor = s.factor if s.factor else max_position_embeddings / original
    if s.attention_factor is not None:
        attention_factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency (high-frequency dims), 0: interpolate
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention_factor)


def _longrope(
    dim: int, theta: float, s: RopeScaling, max_position_embeddings: int, seq_len: int
) -> tuple[torch.Tensor, float]:
    original = s.original_max_position_embeddings
    factor = max_position_embeddings / original  # Phi-3: the ratio of the windows, not a stored factor
    if s.attention_factor is not None:
        attention_factor = s.attention_factor
    elif factor <= 1.0:
        attention_factor = 1.0
    else:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    ext = s.long_factor if seq_len > original else s.short_factor
    if len(ext) != dim // 2:
        raise ModelLoadError(f"longrope factors have {len(ext)} entries, expected {dim // 2}")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta**exponents), attention_factor


class RotaryEmbedding(nn.Module):
    """``cos``/``sin`` tables of ``max_positions`` positions and the rotation that applies them.

    :param head_dim: rotated dimensions per head (the whole head).
    :param max_positions: table length: the longest sequence served (positions ``0 .. max_positions-1``).
    :param theta: RoPE base.
    :param scaling: the checkpoint's scaling scheme, or None for plain RoPE.
    :param max_position_embeddings: the config's context window (read by dynamic / yarn / longrope).
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None = None,
        max_position_embeddings: int | None = None,
    ) -> None:
        super().__init__()
        window = max_position_embeddings or max_positions
        # Computed on the CPU even under a ``torch.device`` context (a decoder skeleton built on "meta"):
        # the tables are small, and meta tensors would route these ops through Python decompositions.
        with torch.device("cpu"):
            inv_freq, factor = inv_freq_and_factor(head_dim, theta, scaling, window, max_positions)
            angles = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]  # [P, D/2]
        self.max_positions = max_positions
        self.attention_factor = factor
        cos, sin = angles.cos(), angles.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        self.register_buffer("cos", cos, persistent=False)  # [P, D/2] float32
        self.register_buffer("sin", sin, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-width ``cos`` and sign-folded ``sin`` ``[T, 1, D]`` for :meth:`rotate`: built once per
        forward call and shared by every layer (and by Q and K)."""
        if torch.compiler.is_compiling():  # traced code keeps no state: the same values from the gathered rows
            cos, sin = self.cos[positions], self.sin[positions]  # [T, D/2] float32
            return torch.cat((cos, cos), -1).to(dtype)[:, None, :], torch.cat((-sin, sin), -1).to(dtype)[:, None, :]
        cos, sin = self._full_tables(dtype)
        # index_select: the rows of cos[positions], without advanced indexing's Python and dispatch
        return cos.index_select(0, positions).unsqueeze(1), sin.index_select(0, positions).unsqueeze(1)

    def _full_tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[P, D]`` ``cat(cos, cos)`` and ``cat(-sin, sin)`` in ``dtype`` (the same values as building them from
        the gathered rows), made once per dtype and table: a step then gathers its rows, nothing more."""
        cos, sin = self.cos, self.sin
        cached = vars(self).get("_full")
        if cached is None or cached[0] is not cos or cached[1] is not sin or cached[2] != dtype:
            full = torch.cat((cos, cos), -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype)
            self._full = cached = (cos, sin, dtype, full)
        return cached[3]

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, heads, D]`` rotated: ``[x1·c − x2·s, x2·c + x1·s]`` (bitwise the same as spelling the
        halves out: ``x2·(−s) = −(x2·s)`` exactly), in four kernels."""
        t, n, d = x.shape
        swapped = x.reshape(t, n, 2, d // 2).flip(2).view(t, n, d)  # [x2, x1], a new tensor
        return (x * cos).add_(swapped.mul_(sin))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, D]`` by the angles of ``positions`` ``[T]``."""
        return self.rotate(x, *self.tables(positions, x.dtype))
