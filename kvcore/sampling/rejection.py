"""Which draft tokens a verification keeps: the acceptance rules of speculative decoding.

Two rules, both leaving each emitted token distributed exactly as the target's sampler would draw it:

* :func:`num_matching`: for greedy rows, and for sampled rows whose drafts are deterministic (one-hot
  ``q``). The target's sampler picks a token at every draft position (its history extended by the drafts
  before it); drafts are kept while they equal those picks. With ``q`` one-hot at ``x`` this *is* the
  rejection rule: ``x`` is kept with probability ``p(x) = min(1, p(x)/q(x))``, and on a mismatch the pick is
  a draw from ``p`` without ``x``, i.e. from ``norm(max(0, p - q))``. A sampler keyed by (seed, step), as
  the default one is, then gives the very stream it gives without speculation.
* :func:`rejection_sample`: for sampled rows whose proposer drew its drafts from a distribution ``q``
  (Leviathan et al. 2023, Chen et al. 2023): keep draft ``x`` with probability ``min(1, p(x)/q(x))``; at
  the first rejection draw from ``norm(max(0, p - q))`` instead and stop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore.sampling.processors import uniform_noise

__all__ = ["num_matching", "rejection_sample"]

#: seed offsets of the acceptance draws and the residual draws: streams apart from the sampler's own
ACCEPT_SALT = 0x5BEC0001
RESIDUAL_SALT = 0x5BEC0002


def num_matching(drafts: Sequence[int], picks: Sequence[int]) -> int:
    """How many leading ``drafts`` equal the target's ``picks`` at the same positions."""
    n = 0
    for draft, pick in zip(drafts, picks):
        if draft != pick:
            break
        n += 1
    return n


def rejection_sample(
    drafts: Sequence[int], p: torch.Tensor, q: torch.Tensor, seed: int, step: int
) -> tuple[int, int | None]:
    """Verify sampled drafts: ``(number kept, the token drawn at the first rejection or None)``.

    :param p: ``[k, V]`` the target's probabilities at each draft position (after the sampler's processing).
    :param q: ``[k, V]`` the distributions the proposer drew ``drafts`` from.
    :param seed: the request's seed; ``step``: how many tokens it had generated before the first draft. The
        draws are a pure function of (seed, step + i), so a verification is reproducible.
    """
    p, q = p.double(), q.double().to(p.device)
    vocab = p.shape[-1]
    for i, x in enumerate(drafts):
        u = float(uniform_noise([seed + ACCEPT_SALT], [step + i], 1, p.device)[0, 0])
        px, qx = float(p[i, x]), float(q[i, x])
        if px > 0 and u * qx <= px:  # u < p/q, without dividing by a q of zero
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: the residual is empty, p itself is the rule's limit
            residual = p[i]
        g = uniform_noise([seed + RESIDUAL_SALT], [step + i], vocab, p.device)[0]
        return i, int((residual.log() - (-g.log()).log()).argmax())  # Gumbel-max draw from norm(residual)
    return len(drafts), None
