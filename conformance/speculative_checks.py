"""What the speculative tier checks of a proposer beyond the streams: that the draft distribution ``q`` it reports is
the one its drafts were drawn from, and that it leaves the target model as it found it.

``q``: every sampled draft of a run is recorded with its reported row ``q`` (``Proposal.probs``). If each token
``t`` is drawn from its ``q``, the randomised probability integral transform ``u = F(t) + U · q(t)`` (``F(t)`` the
mass of the tokens ranked before ``t``, most probable first, ties by id; ``U`` uniform) is uniform on [0, 1),
whatever each ``q`` is; the ``u`` of all drafts go into :data:`BINS` equal bins and a chi-square test at the
tier's false-alarm rate. Ranked by ``q``, drafts drawn from a sharper distribution pile up near 0, from a flatter
one near 1. A proposer that draws
at one temperature and reports ``q`` at another fails it, as does one reporting a ``q`` it never drew from.

The target: its weights and buffers, its config and every layer's attention settings (scale, window, soft-cap,
sinks, bound variants) are recorded before a case and compared after it; a proposer sees the target model
(:class:`~kvcore.interfaces.proposer.ProposerTarget`) but may not change it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["BINS", "DraftRecorder", "chi2_quantile", "model_state", "model_changes", "pit_uniformity"]

#: bins of the q check's chi-square (each expected to hold many draws)
BINS = 10


class DraftRecorder:
    """Wraps a proposer's ``propose`` to keep ``(token, q row)`` of every sampled draft it returns."""

    def __init__(self, proposer) -> None:
        self.draws: list[tuple[int, torch.Tensor]] = []
        real = proposer.propose

        def propose(rows, num_tokens):
            out = real(rows, num_tokens)
            for proposal in out:
                if proposal.probs is not None:
                    probs = torch.as_tensor(proposal.probs).detach().double().cpu()
                    self.draws += [(int(t), probs[i]) for i, t in enumerate(proposal.token_ids)]
            return out

        proposer.propose = propose


def pit_uniformity(draws: list[tuple[int, torch.Tensor]], seed: int = 0) -> tuple[float, int]:
    """``(chi-square, degrees of freedom)`` of the randomised PIT values of ``draws`` over :data:`BINS` bins."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(BINS, dtype=torch.float64)
    for token, q in draws:
        q = q / q.sum()
        below = float(q[q > q[token]].sum()) + float(q[:token][q[:token] == q[token]].sum())  # ranked by q
        u = below + float(torch.rand((), generator=gen, dtype=torch.float64)) * float(q[token])
        counts[min(int(u * BINS), BINS - 1)] += 1
    expected = len(draws) / BINS
    return float(((counts - expected) ** 2 / expected).sum()), BINS - 1


def model_state(model) -> dict[str, object]:
    """What a proposer may not change: every parameter and buffer (copies), the config and the attention
    settings of each layer."""
    layers = [(a.scale, a.sliding_window, a.softcap, None if a.sinks is None else a.sinks.clone(), a.mods)
              for a in model.attention_layers]
    tensors = {n: t.detach().clone() for n, t in (*model.named_parameters(), *model.named_buffers())}
    return {"tensors": tensors, "config": model.config, "layers": layers}


def model_changes(before: dict[str, object], model) -> str | None:
    """The first difference between ``before`` (:func:`model_state`) and ``model`` now, or None."""
    after = model_state(model)
    if after["config"] != before["config"]:
        return "the model's config changed"
    if len(after["layers"]) != len(before["layers"]):
        return "the model's number of attention layers changed"
    names = ("scale", "sliding window", "soft-cap", "sinks", "attention variants")
    for i, (old, new) in enumerate(zip(before["layers"], after["layers"])):
        for name, a, b in zip(names, old, new):
            if name == "sinks":
                same = (a is None) == (b is None) and (a is None or torch.equal(a, b))
            else:
                same = a == b
            if not same:
                return f"layer {i}'s attention {name} changed from {a} to {b}"
    for name, old in before["tensors"].items():
        new = after["tensors"].get(name)
        if new is None or new.shape != old.shape or not torch.equal(new, old):
            return f"the model's weight '{name}' changed"
    if set(after["tensors"]) != set(before["tensors"]):
        return "the model's set of weights changed"
    return None


def chi2_quantile(q: float, dof: int) -> float:
    """Wilson–Hilferty approximation of the chi-square quantile (ample for a false-alarm bound)."""
    z = math.sqrt(2) * _erfinv(2 * q - 1)
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _erfinv(y: float) -> float:
    return float(torch.special.erfinv(torch.tensor(y, dtype=torch.float64)))
