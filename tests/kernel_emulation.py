"""CPU emulations of the GPU attention kernels that ``flash_attn2`` and ``xformers`` call.

A testing module, not part of the kvcore runtime package: ``tests/backends/test_gpu_backends_emulated.py`` and
``scripts/gpu_check.py --emulate`` import it from ``tests/`` and pass ``FLASH_KERNELS`` /
``XFORMERS_KERNELS`` to the backends as ``kernels=``.

flash-attn and xformers only run on CUDA, so their backends cannot be exercised on a CPU-only machine.
Everything *around* the kernel call is still ours, though — packing, ``cu_seqlens``, ``cache_seqlens``,
``cache_batch_idx``, the attention-bias objects, the 5-D GQA reshape, the cache writes — and that glue
is where integration bugs live. The functions here re-implement each kernel's **documented** contract in
plain PyTorch (float32 math, any device), so the backends' production glue can run against them and be
compared with the ``naive`` oracle. They were written from the libraries' docstrings, not their code:

* ``flash_attn.flash_attn_varlen_func`` (flash-attn 2.x): packed ``q [total_q, H, D]``,
  ``k/v [total_k, H_kv, D]``, int32 ``cu_seqlens_q/k [B + 1]``; ``causal=True`` is aligned to the
  **bottom-right** corner of each sequence's ``(seqlen_q, seqlen_k)`` matrix (since 2.1); a query row whose
  mask is all zero outputs 0; query head ``h`` reads KV head ``h // (H / H_kv)``; ``window_size = (left,
  right)`` other than ``(-1, -1)``: "query at position i will only attend to keys between [i + seqlen_k -
  seqlen_q - window_size[0], i + seqlen_k - seqlen_q + window_size[1]] inclusive"; ``softcap > 0``: the
  scaled scores become ``softcap · tanh(s / softcap)`` before masking (both kernels).
* ``flash_attn.flash_attn_with_kvcache``: ``q [B, seqlen_q, H, D]``; ``k_cache [B_cache, seqlen_cache,
  H_kv, D]`` (or paged ``[num_blocks, page_block_size, H_kv, D]`` with an int32 ``block_table
  [B, max_blocks]``, ``page_block_size`` a multiple of 256); when ``k``/``v`` are given they are written
  **in place** into the cache starting at ``cache_seqlens[b]`` (the length *before* the append) of cache
  row ``cache_batch_idx[b]``, and attention then covers ``cache_seqlens[b] + seqlen_new`` keys.
* ``xformers.ops.memory_efficient_attention``: ``[B, M, H, K]`` or, for GQA, ``[B, M, G, H, K]`` inputs
  whose K/V are broadcast by the caller (xformers does not broadcast); ``scale`` defaults to
  ``K ** -0.5``; ``attn_bias`` is added to ``Q Kᵀ`` before the softmax; fully masked rows output 0.
* ``xformers.ops.fmha.attn_bias.BlockDiagonalCausalMask``,
  ``BlockDiagonalCausalWithOffsetPaddedKeysMask`` and ``BlockDiagonalCausalWithOffsetGappyKeysMask``,
  materialized per their docstrings.

These are oracles for the glue, not fast paths: they loop over sequences. They are deliberately stricter
than the real kernels — a wrong ``cu_seqlens``, a too-small ``max_seqlen`` or an append past the end of a
cache row raises ``ValueError`` here, where the CUDA kernel would silently read or write garbage. Beyond
that, fp32 inputs are accepted (the real kernels take fp16/bf16 only; xformers also fp32) so tests can
compare exactly on CPU. Features the backends never use (dropout, ALiBi, rotary, left padding) raise
``NotImplementedError`` rather than being guessed at.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

__all__ = [
    "emulated_flash_attn_varlen_func",
    "emulated_flash_attn_with_kvcache",
    "emulated_memory_efficient_attention",
    "EmulatedBlockDiagonalCausalMask",
    "EmulatedBlockDiagonalCausalWithOffsetPaddedKeysMask",
    "EmulatedBlockDiagonalCausalWithOffsetGappyKeysMask",
    "FLASH_KERNELS",
    "XFORMERS_KERNELS",
]

_NEG_INF = float("-inf")


# -- shared core ---------------------------------------------------------------------------------------
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, scale: float,
            softcap: float = 0.0):
    """softmax(scale · Q Kᵀ + mask) V in float32 for one block, GQA by head grouping (``softcap > 0``: the
    scaled scores capped, ``softcap · tanh(s / softcap)``, before the mask).

    q ``[Lq, H, D]``, k/v ``[Lk, H_kv, D]``, allowed ``[Lq, Lk]`` bool (True = may attend) or None.
    Returns (out ``[Lq, H, D]`` float32, lse ``[H, Lq]`` float32). Rows with nothing allowed give 0 / -inf.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"number of query heads {num_heads} is not a multiple of KV heads {num_kv_heads}")
    kv_head_of = torch.arange(num_heads, device=q.device) // (num_heads // num_kv_heads)
    Q = q.float().transpose(0, 1)  # (H, Lq, D)
    K = k.float().transpose(0, 1)[kv_head_of]  # (H, Lk, D)
    V = v.float().transpose(0, 1)[kv_head_of]
    S = (Q @ K.transpose(-2, -1)) * scale  # (H, Lq, Lk)
    if softcap > 0:
        S = torch.tanh(S / softcap) * softcap
    if allowed is not None:
        S = S.masked_fill(~allowed, _NEG_INF)
    lse = torch.logsumexp(S, dim=-1)  # (H, Lq); -inf for fully masked rows
    dead = torch.isneginf(lse)
    P = torch.exp(S - lse.masked_fill(dead, 0.0)[..., None])  # exp(-inf) = 0 on dead rows
    out = (P @ V).transpose(0, 1)  # (Lq, H, D)
    return out, lse


def _bottom_right_causal(seqlen_q: int, seqlen_k: int, device: torch.device) -> torch.Tensor:
    """flash-attn ≥ 2.1 causal mask: query i may see key j iff j <= i + seqlen_k - seqlen_q."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def _flash_allowed(
    seqlen_q: int, seqlen_k: int, causal: bool, window_size: Sequence[int], device: torch.device
) -> torch.Tensor | None:
    """flash-attn's mask: bottom-right causal and/or the local window (None: every key)."""
    left, right = window_size
    if causal:
        right = 0  # flash-attn: causal is window_size[1] = 0
    if left < 0 and (right < 0 or (causal and seqlen_q == 1)):
        return _bottom_right_causal(seqlen_q, seqlen_k, device) if causal and seqlen_q > 1 else None
    i = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device)[None, :]
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    return allowed


def _check_int32_vector(name: str, t: Any, length: int | None = None) -> list[int]:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D torch.int32 tensor, got {t!r}")
    if length is not None and t.numel() != length:
        raise ValueError(f"{name} must have {length} entries, got {t.numel()}")
    return [int(x) for x in t.tolist()]


def _check_cu_seqlens(name: str, cu: Any, total: int) -> list[int]:
    vals = _check_int32_vector(name, cu)
    if len(vals) < 2 or vals[0] != 0 or any(b < a for a, b in zip(vals, vals[1:])) or vals[-1] != total:
        raise ValueError(f"{name}={vals} is not a prefix sum starting at 0 and ending at the {total} packed rows")
    return vals


def _unsupported(**features: Any) -> None:
    for name, (value, default) in features.items():
        changed = value is not None if default is None else value != default
        if changed:
            raise NotImplementedError(f"the emulation does not implement {name}={value!r}")


def _check_dtypes(*tensors: torch.Tensor) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise ValueError(f"q, k and v must share one dtype, got {sorted(map(str, dtypes))}")
    (dtype,) = dtypes
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {dtype}")


def _check_head_dim(head_dim: int) -> None:
    if head_dim > 256:
        raise ValueError(f"FlashAttention forward only supports head dimension at most 256, got {head_dim}")


# -- flash-attn 2.x -----------------------------------------------------------------------------------
def emulated_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Emulates ``flash_attn.flash_attn_varlen_func`` (forward, no dropout). Returns ``[total_q, H, D]``."""
    _unsupported(
        dropout_p=(dropout_p, 0.0),
        alibi_slopes=(alibi_slopes, None),
        return_attn_probs=(return_attn_probs, False),
        block_table=(block_table, None),
    )
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"varlen expects 3-D q/k/v, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"incompatible q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    _check_dtypes(q, k, v)
    _check_head_dim(q.shape[-1])
    cq = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    ck = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q has {len(cq)} entries but cu_seqlens_k has {len(ck)}")
    lens_q = [b - a for a, b in zip(cq, cq[1:])]
    lens_k = [b - a for a, b in zip(ck, ck[1:])]
    if max(lens_q) > max_seqlen_q or max(lens_k) > max_seqlen_k:
        raise ValueError(
            f"max_seqlen_q={max_seqlen_q} / max_seqlen_k={max_seqlen_k} are below the longest sequences "
            f"({max(lens_q)} / {max(lens_k)}): the kernel would skip rows"
        )
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(len(lens_q)):
        if lens_q[b] == 0:
            continue
        qi, ki, vi = q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]]
        allowed = _flash_allowed(lens_q[b], lens_k[b], causal, window_size, q.device)
        out[cq[b] : cq[b + 1]] = _attend(qi, ki, vi, allowed, scale, softcap)[0]
    return out.to(q.dtype)


def emulated_flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
):
    """Emulates ``flash_attn.flash_attn_with_kvcache``, including the in-place append of ``k``/``v``.

    Returns ``out [B, seqlen_q, H, D]`` (and ``lse [B, H, seqlen_q]`` with ``return_softmax_lse``).
    """
    _unsupported(
        rotary_cos=(rotary_cos, None),
        rotary_sin=(rotary_sin, None),
        cache_leftpad=(cache_leftpad, None),
        alibi_slopes=(alibi_slopes, None),
    )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have a contiguous last dimension")
    if q.dim() != 4 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    batch, seqlen_q, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not match k_cache {tuple(k_cache.shape)}")
    _check_dtypes(q, k_cache, v_cache)
    _check_head_dim(head_dim)
    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("Paged KVcache does not support cache_batch_idx")
        table = block_table
        if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != batch:
            raise ValueError(f"block_table must be int32 [batch, max_blocks], got {table.dtype} {tuple(table.shape)}")
        page = k_cache.shape[1]
        if page % 256:
            raise ValueError(f"Paged KV cache block size must be divisible by 256, got {page}")
        capacity = table.shape[1] * page
    else:
        capacity = k_cache.shape[1]
        rows = (
            list(range(batch))
            if cache_batch_idx is None
            else _check_int32_vector("cache_batch_idx", cache_batch_idx, batch)
        )
        if any(not 0 <= r < k_cache.shape[0] for r in rows):
            raise ValueError(f"cache_batch_idx {rows} out of range for {k_cache.shape[0]} cache rows")
    if cache_seqlens is None:
        lens = [capacity] * batch
    elif isinstance(cache_seqlens, int):
        lens = [cache_seqlens] * batch
    else:
        lens = _check_int32_vector("cache_seqlens", cache_seqlens, batch)

    def locate(b: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, offset) indices into k_cache's first two dims for logical positions of batch row b."""
        if paged:
            blocks = table[b].long()[positions // page]
            return blocks, positions % page
        return torch.full_like(positions, rows[b]), positions

    seqlen_new = 0
    if (k is None) != (v is None):
        raise ValueError("If key is supplied, value must also be passed in")
    if k is not None:
        if cache_seqlens is None:
            raise ValueError("If key is supplied, cache_seqlens must also be passed in")
        if k.dim() != 4 or k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:] or k.shape != v.shape:
            raise ValueError(
                f"k/v {tuple(k.shape)} must be [batch, seqlen_new, H_kv, D] like k_cache {tuple(k_cache.shape)}"
            )
        _check_dtypes(q, k, v)
        if head_dim % 8:
            # the real kernel pads q/k_cache/v_cache to a multiple of 8 first: the append lands in the copy
            raise ValueError(f"head_dim {head_dim} is not a multiple of 8: the in-place append would be lost")
        seqlen_new = k.shape[1]
        for b in range(batch):
            if lens[b] + seqlen_new > capacity:
                raise ValueError(f"append past the end of the cache: {lens[b]} + {seqlen_new} > {capacity}")
            pos = torch.arange(lens[b], lens[b] + seqlen_new, device=k_cache.device)
            r, o = locate(b, pos)
            k_cache[r, o] = k[b]
            v_cache[r, o] = v[b]
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, num_heads, seqlen_q), _NEG_INF, dtype=torch.float32, device=q.device)
    for b in range(batch):
        seqlen_k = lens[b] + seqlen_new
        if seqlen_k > capacity:
            raise ValueError(f"cache_seqlens[{b}]={lens[b]} exceeds the cache capacity {capacity}")
        r, o = locate(b, torch.arange(seqlen_k, device=k_cache.device))
        allowed = _flash_allowed(seqlen_q, seqlen_k, causal, window_size, q.device)
        out[b], lse[b] = _attend(q[b], k_cache[r, o], v_cache[r, o], allowed, scale, softcap)
    out = out.to(q.dtype)
    return (out, lse) if return_softmax_lse else out


# -- xformers -----------------------------------------------------------------------------------------
class _EmulatedBias:
    """Base of the emulated attention biases: materialize() gives the additive mask (0 or -inf)."""

    q_seqstart: list[int]
    k_starts: list[int]
    k_lens: list[int]
    device: torch.device

    def _allowed_block(self, num_queries: int, num_keys: int) -> torch.Tensor:
        raise NotImplementedError

    def allowed(self, num_queries: int, num_keys: int) -> torch.Tensor:
        """Boolean ``[num_queries, num_keys]``: True where the mask lets a query see a key."""
        if num_queries != self.q_seqstart[-1]:
            raise ValueError(f"{type(self).__name__} covers {self.q_seqstart[-1]} queries, got {num_queries}")
        if num_keys < self.k_starts[-1] + self.k_lens[-1]:
            raise ValueError(f"{type(self).__name__} reaches key {self.k_starts[-1] + self.k_lens[-1]}, got {num_keys}")
        mask = torch.zeros(num_queries, num_keys, dtype=torch.bool)
        for i, (k0, lk) in enumerate(zip(self.k_starts, self.k_lens)):
            q0, q1 = self.q_seqstart[i], self.q_seqstart[i + 1]
            mask[q0:q1, k0 : k0 + lk] = self._allowed_block(q1 - q0, lk)
        return mask

    def materialize(self, shape: Sequence[int], dtype: torch.dtype = torch.float32, device: Any = "cpu"):
        allowed = self.allowed(shape[-2], shape[-1]).to(device)
        bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, _NEG_INF)
        return bias.expand(tuple(shape))


def _seqstart(lens: Sequence[int]) -> list[int]:
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + int(n))
    return starts


class EmulatedBlockDiagonalCausalMask(_EmulatedBias):
    """``BlockDiagonalCausalMask``: sequences packed back to back along M for both queries and keys;
    query i of block b sees keys 0..i of block b (top-left causal, per its docstring: a query cannot
    attend to a key farther from the block's first key than the query is from its first query)."""

    def __init__(self, q_seqlen: Sequence[int], kv_seqlen: Sequence[int], device: torch.device) -> None:
        self.q_seqstart = _seqstart(q_seqlen)
        self.k_lens = [int(n) for n in kv_seqlen]
        self.k_starts = _seqstart(self.k_lens)[:-1]
        self.device = device

    @classmethod
    def from_seqlens(cls, q_seqlen: Sequence[int], kv_seqlen: Sequence[int] | None = None, *, device=None):
        if kv_seqlen is not None and len(kv_seqlen) != len(q_seqlen):
            raise ValueError(f"{len(q_seqlen)} query blocks but {len(kv_seqlen)} key blocks")
        return cls(q_seqlen, q_seqlen if kv_seqlen is None else kv_seqlen, torch.device(device or "cpu"))

    def _allowed_block(self, num_queries: int, num_keys: int) -> torch.Tensor:
        i = torch.arange(num_queries)[:, None]
        return torch.arange(num_keys)[None, :] <= i


class EmulatedBlockDiagonalCausalWithOffsetPaddedKeysMask(_EmulatedBias):
    """``BlockDiagonalCausalWithOffsetPaddedKeysMask``: queries packed back to back; keys in blocks of
    ``kv_padding`` slots of which the first ``kv_seqlen[b]`` are in use. Per its docstring, a query in
    block b cannot attend to a key outside block b, nor to padding, nor to a key nearer to the block's
    final key than the query is to the block's final query (bottom-right causal)."""

    def __init__(self, q_seqlen: Sequence[int], kv_padding: int, kv_seqlen: Sequence[int], device) -> None:
        if len(q_seqlen) != len(kv_seqlen):
            raise ValueError(f"{len(q_seqlen)} query blocks but {len(kv_seqlen)} key blocks")
        if any(int(n) > kv_padding for n in kv_seqlen):
            raise ValueError(f"kv_seqlen {list(kv_seqlen)} exceeds kv_padding {kv_padding}")
        self.q_seqstart = _seqstart(q_seqlen)
        self.k_lens = [int(n) for n in kv_seqlen]
        self.k_starts = [b * kv_padding for b in range(len(self.k_lens))]
        self.kv_padding = kv_padding
        self.device = torch.device(device or "cpu")

    @classmethod
    def from_seqlens(
        cls,
        q_seqlen: Sequence[int],
        kv_padding: int,
        kv_seqlen: Sequence[int],
        causal_diagonal: Any = None,
        *,
        device=None,
    ):
        return cls(q_seqlen, kv_padding, kv_seqlen, device)

    def allowed(self, num_queries: int, num_keys: int) -> torch.Tensor:
        if num_keys != self.kv_padding * len(self.k_lens):
            raise ValueError(f"keys must span {len(self.k_lens)} blocks of {self.kv_padding}, got {num_keys}")
        return super().allowed(num_queries, num_keys)

    def _allowed_block(self, num_queries: int, num_keys: int) -> torch.Tensor:
        return _bottom_right_causal(num_queries, num_keys, torch.device("cpu"))


class EmulatedBlockDiagonalCausalWithOffsetGappyKeysMask(_EmulatedBias):
    """``BlockDiagonalCausalWithOffsetGappyKeysMask``: queries packed back to back; block b's keys are the
    ``kv_seqlen[b]`` rows from ``kv_seqstarts[b]``, anywhere along M (the final start is M itself). Per its
    docstring, a query in block b cannot attend to a key outside block b, nor to one nearer to the block's
    final key than the query is to the block's final query (bottom-right causal)."""

    def __init__(self, q_seqlen: Sequence[int], kv_seqstarts: Sequence[int], kv_seqlen: Sequence[int], device):
        if len(kv_seqstarts) != len(kv_seqlen) + 1:
            raise ValueError(f"len(kv_seqstarts)={len(kv_seqstarts)} should be len(kv_seqlen)+1={len(kv_seqlen) + 1}")
        if len(q_seqlen) != len(kv_seqlen):
            raise ValueError(f"{len(q_seqlen)} query blocks but {len(kv_seqlen)} key blocks")
        self.q_seqstart = _seqstart(q_seqlen)
        self.k_starts = [int(s) for s in kv_seqstarts[:-1]]
        self.k_lens = [int(n) for n in kv_seqlen]
        self.total_keys = int(kv_seqstarts[-1])
        if any(s + n > self.total_keys for s, n in zip(self.k_starts, self.k_lens)):
            raise ValueError(f"a key block runs past the final start {self.total_keys}")
        self.device = torch.device(device or "cpu")

    @classmethod
    def from_seqlens(cls, q_seqlen: Sequence[int], kv_seqstarts: Sequence[int], kv_seqlen: Sequence[int], *,
                     device=None):
        return cls(q_seqlen, kv_seqstarts, kv_seqlen, device)

    def allowed(self, num_queries: int, num_keys: int) -> torch.Tensor:
        if num_keys != self.total_keys:
            raise ValueError(f"keys must span the final start {self.total_keys}, got {num_keys}")
        if num_queries != self.q_seqstart[-1]:
            raise ValueError(f"{type(self).__name__} covers {self.q_seqstart[-1]} queries, got {num_queries}")
        mask = torch.zeros(num_queries, num_keys, dtype=torch.bool)
        for i, (k0, lk) in enumerate(zip(self.k_starts, self.k_lens)):
            q0, q1 = self.q_seqstart[i], self.q_seqstart[i + 1]
            mask[q0:q1, k0 : k0 + lk] = _bottom_right_causal(q1 - q0, lk, torch.device("cpu"))
        return mask


def emulated_memory_efficient_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: Any = None,
    p: float = 0.0,
    scale: float | None = None,
    *,
    op: Any = None,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Emulates ``xformers.ops.memory_efficient_attention`` (forward, no dropout) for BMHK / BMGHK inputs."""
    _unsupported(p=(p, 0.0), op=(op, None))
    if not (query.dim() == key.dim() == value.dim()) or query.dim() not in (4, 5):
        raise ValueError(f"query/key/value must all be BMHK or BMGHK, got {query.shape}, {key.shape}, {value.shape}")
    if key.shape != value.shape or query.shape[0] != key.shape[0] or query.shape[2:] != key.shape[2:]:
        # xformers does not broadcast: for GQA the caller expands K/V to the query's [G, H] itself.
        raise ValueError(f"incompatible shapes q {tuple(query.shape)}, k {tuple(key.shape)}, v {tuple(value.shape)}")
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("query/key/value need a contiguous last dimension")
    _check_dtypes(query, key, value)
    if isinstance(attn_bias, torch.Tensor):
        raise NotImplementedError("tensor biases are not emulated (the backends never pass one)")
    if attn_bias is not None and not isinstance(attn_bias, _EmulatedBias) and not hasattr(attn_bias, "materialize"):
        raise NotImplementedError(f"the emulation does not implement attn_bias {type(attn_bias).__name__}")
    if attn_bias is not None:  # ours, or a real xformers bias object (their materialize() works on CPU)
        if query.shape[0] != 1:
            raise ValueError(f"Expected batch_size=1 when using block-diagonal bias, got {query.shape[0]}")
        seqinfo = getattr(attn_bias, "q_seqinfo", None)
        bias_device = attn_bias.device if isinstance(attn_bias, _EmulatedBias) else seqinfo.seqstart.device
        if bias_device != query.device:
            raise ValueError("Attention bias and Query/Key/Value should be on the same device")
    batch, mq, mk = query.shape[0], query.shape[1], key.shape[1]
    head_shape = query.shape[2:-1]
    heads = math.prod(head_shape)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    Q = query.reshape(batch, mq, heads, query.shape[-1])  # (B, Mq, GH, K)
    K = key.reshape(batch, mk, heads, key.shape[-1])  # expanded K/V are copied here: fine for an oracle
    V = value.reshape(batch, mk, heads, value.shape[-1])
    out = torch.empty(batch, mq, heads, value.shape[-1], dtype=torch.float32, device=query.device)
    if attn_bias is None:
        allowed = None
    elif isinstance(attn_bias, _EmulatedBias):
        allowed = attn_bias.allowed(mq, mk).to(query.device)
    else:
        allowed = torch.isfinite(attn_bias.materialize((mq, mk), dtype=torch.float32, device=query.device))
    for b in range(batch):
        out[b] = _attend(Q[b], K[b], V[b], allowed, scale)[0]
    return out.reshape(*query.shape[:-1], value.shape[-1]).to(output_dtype or query.dtype)


#: stand-ins for the ``flash_attn`` module as the flash_attn2 backend uses it (``kernels=`` option)
FLASH_KERNELS = SimpleNamespace(
    flash_attn_varlen_func=emulated_flash_attn_varlen_func,
    flash_attn_with_kvcache=emulated_flash_attn_with_kvcache,
    __name__="kernel_emulation (flash-attn emulation)",
)

#: stand-ins for the xformers entry points the xformers backend uses (``kernels=`` option)
XFORMERS_KERNELS = SimpleNamespace(
    memory_efficient_attention=emulated_memory_efficient_attention,
    BlockDiagonalCausalMask=EmulatedBlockDiagonalCausalMask,
    BlockDiagonalCausalWithOffsetPaddedKeysMask=EmulatedBlockDiagonalCausalWithOffsetPaddedKeysMask,
    BlockDiagonalCausalWithOffsetGappyKeysMask=EmulatedBlockDiagonalCausalWithOffsetGappyKeysMask,
    __name__="kernel_emulation (xformers emulation)",
)
