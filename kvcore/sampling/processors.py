"""Vectorised logits processing for the default sampler: bias and penalties, min-p, the counter-based noise,
and reading log-probabilities back.

Every function works on a whole batch at once on the logits' device: one scatter / gather per feature,
no Python loop over tokens or vocabulary entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch.nn.utils.rnn import pad_sequence

from kvcore.kernels.cpu_kernels import kernels_loaded

if TYPE_CHECKING:
    from kvcore.interfaces.sampler import SamplingRow

__all__ = ["apply_penalties", "argmax_rows", "min_p_mask", "uniform_noise", "token_logprobs"]


def _padded(seqs: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """``[R, L]`` int64 ids, rows right-padded with ``pad`` (an id one past the vocabulary)."""
    tensors = [torch.as_tensor(s, dtype=torch.int64) for s in seqs]
    return pad_sequence(tensors, batch_first=True, padding_value=pad).to(device)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Apply ``logit_bias``, then ``repetition_penalty`` (prompt + output tokens, the last ``repetition_window``
    of them when it is set), then ``frequency_penalty``
    and ``presence_penalty`` (output tokens) to ``logits`` ``[B, V]`` in place (vLLM's order and formulas).

    Repetition (CTRL, transformers' ``RepetitionPenaltyLogitsProcessor``): a seen token's logit ``x``
    becomes ``x / p`` if ``x > 0`` else ``x * p``. OpenAI: ``x -= frequency * count + presence * (count > 0)``
    with ``count`` the token's occurrences in the output so far.
    """
    picked = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not picked:
        return
    device, vocab = logits.device, logits.shape[-1]
    sub = [rows[i] for i in picked]
    index = torch.tensor(picked, device=device)
    x = logits[index].float()  # [P, V]
    bias = [(j, t, b) for j, r in enumerate(sub) for t, b in r.params.logit_bias if t < vocab]
    if bias:
        j, t, b = zip(*bias)
        ij = (torch.tensor(j, device=device), torch.tensor(t, device=device))
        x.index_put_(ij, torch.tensor(b, dtype=x.dtype, device=device), accumulate=True)
    rep = [r.params.repetition_penalty for r in sub]
    if any(p != 1.0 for p in rep):
        ids = _padded([_recent(r) for r in sub], vocab, device)  # [P, L]
        seen = torch.zeros(len(sub), vocab + 1, dtype=torch.bool, device=device).scatter_(1, ids, True)[:, :vocab]
        p = torch.tensor(rep, dtype=x.dtype, device=device)[:, None]
        x = torch.where(seen, torch.where(x > 0, x / p, x * p), x)
    freq = [r.params.frequency_penalty for r in sub]
    pres = [r.params.presence_penalty for r in sub]
    if any(freq) or any(pres):
        out = _padded([list(r.output_ids) for r in sub], vocab, device)  # [P, L_out]
        counts = torch.zeros(len(sub), vocab + 1, dtype=x.dtype, device=device)
        counts = counts.scatter_add_(1, out, torch.ones_like(out, dtype=x.dtype))[:, :vocab]  # [P, V]
        f = torch.tensor(freq, dtype=x.dtype, device=device)[:, None]
        q = torch.tensor(pres, dtype=x.dtype, device=device)[:, None]
        x = x - f * counts - q * (counts > 0).to(x.dtype)
    logits[index] = x.to(logits.dtype)


def _recent(row: SamplingRow) -> list[int]:
    """The tokens ``repetition_penalty`` counts as seen: prompt + output, or the last ``repetition_window``."""
    window = row.params.repetition_window
    if window is None:
        return list(row.prompt_ids) + list(row.output_ids)
    recent = list(row.output_ids[-window:])
    if len(recent) < window:  # the window reaches back into the prompt
        recent = list(row.prompt_ids[len(recent) - window:]) + recent
    return recent


#: logits per block of :func:`argmax_rows`
_ARGMAX_BLOCK = 256


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for ``[B, V]`` logits: the same indices (the first maximum; NaN counts as the
    largest, as in ``torch.argmax``), found block by block. On CPU torch's argmax along a row is a scalar loop,
    several times slower than the vectorised ``amax``: each row's blocks of 256 are reduced with ``amax``, the
    first block holding the maximum is picked, and ``argmax`` runs over that block only. A vocabulary that is not a
    multiple of 256 takes ``argmax`` directly. Contiguous float32 CPU logits, where kvcore's kernels are loaded, take
    their ``argmax_rows`` operator: the same search in one call."""
    rows, vocab = logits.shape
    if kernels_loaded() and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        return torch.ops.kvcore.argmax_rows(logits)  # the same search as one operator (csrc/logits.cpp)
    if vocab % _ARGMAX_BLOCK:
        return logits.argmax(-1)
    blocks = logits.reshape(rows, vocab // _ARGMAX_BLOCK, _ARGMAX_BLOCK)
    best = blocks.amax(-1).argmax(-1)  # [B]: the first block holding the row's maximum (or its first NaN)
    within = blocks[torch.arange(rows, device=logits.device), best].argmax(-1)
    return best * _ARGMAX_BLOCK + within


def min_p_mask(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``[S, V]`` True where a token's probability is below ``min_p [S, 1]`` times its row's top probability
    (transformers' ``MinPLogitsWarper``; the top token always stays)."""
    return probs < min_p * probs.amax(dim=-1, keepdim=True)


_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """A 32-bit integer hash (lowbias32 by C. Wellons) of values in ``[0, 2^32)``, on int64 tensors or ints:
    products wrap in int64 but their low 32 bits, all that is kept, are exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: Sequence[int], steps: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[B, V]`` float64 uniforms in (0, 1), a pure function of (row seed, row step, token id).

    Counter-based rather than a stateful generator: a row's draws depend only on its own seed and how many
    tokens it has generated, not on the batch it shares or the device, and the whole batch is one kernel.
    """
    keys = []
    for seed, step in zip(seeds, steps):
        seed %= 1 << 64
        k = _mix32(_mix32(seed & _MASK32) ^ _mix32(((seed >> 32) + 0x9E3779B9) & _MASK32))
        keys.append(_mix32(k ^ _mix32(step & _MASK32)))
    ids = _mix32(torch.arange(vocab_size, dtype=torch.int64, device=device))  # [V]
    h = _mix32(torch.tensor(keys, dtype=torch.int64, device=device)[:, None] ^ ids[None, :])  # [B, V]
    return (_mix32(h ^ 0x5BD1E995).double() + 0.5) / 2.0**32


def token_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int | None]
) -> list[tuple[float, list[tuple[int, float]]] | None]:
    """Per row: ``(logprob of token_ids[i], the num_top[i] most likely (id, logprob) pairs)``, or None where
    ``num_top[i]`` is None. Tokens the processing removed (logprob -inf) are left out of the alternatives.

    :param logprobs: ``[B, V]`` log-probabilities; :param token_ids: ``[B]`` the chosen ids.
    """
    wanted = [i for i, k in enumerate(num_top) if k is not None]
    out: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(num_top)
    if not wanted:
        return out
    index = torch.tensor(wanted, device=logprobs.device)
    lp = logprobs[index].float()  # [W, V]
    chosen = lp.gather(1, token_ids[index][:, None].to(lp.device))[:, 0].tolist()
    k_max = max(num_top[i] for i in wanted)
    top_vals, top_ids = lp.topk(min(k_max, lp.shape[-1]), dim=-1) if k_max else (lp[:, :0], lp[:, :0].long())
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for j, i in enumerate(wanted):
        k = num_top[i]
        pairs = [(t, v) for t, v in zip(top_ids[j][:k], top_vals[j][:k]) if v != float("-inf")]
        out[i] = (chosen[j], pairs)
    return out
