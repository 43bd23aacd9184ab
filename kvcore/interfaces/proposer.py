"""The proposer contract: what speculative decoding asks of a plugin that guesses the next tokens.

Each step, for every running request it speculates on, the engine asks the proposer for up to ``K`` draft
tokens continuing the request's tokens (prompt + output). The target model scores them all in one forward
(a multi-token decode row) and keeps the longest prefix its own sampling agrees with, plus one token of
its own (see docs/speculative.md). A proposer's guesses never change what is generated, only how many
tokens one forward yields: a wrong guess costs the compute of scoring it.

Lifecycle per request: :meth:`Proposer.start` when it begins decoding, :meth:`Proposer.propose` each step
(batched over requests), :meth:`Proposer.advance` with how many of the drafts were accepted,
:meth:`Proposer.finish` when it ends (finished, failed, aborted or preempted: a preempted request starts
again later), once per start and with no call for that request after it. Proposers keep per-request state
keyed by ``request_id``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from kvcore.interfaces.options import unknown_options_error
from kvcore.interfaces.sampler import SamplingParams

__all__ = ["DraftRow", "Proposal", "ProposerCapabilities", "ProposerTarget", "Proposer"]


class DraftRow(Protocol):
    """What a proposer sees of each request: the engine's request state, read only (a proposer that changes a
    row's tokens, e.g. appends its drafts to ``output_ids``, fails that request with a PluginError)."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]  # generated so far; the draft continues prompt_ids + output_ids
    params: SamplingParams
    seed: int


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one request.

    :param token_ids: the guessed continuation, at most the ``num_tokens`` asked for (may be empty).
    :param probs: ``[len(token_ids), V]`` float probabilities, row ``i`` the distribution ``token_ids[i]`` was
        drawn from (a proposer that samples its drafts); None: the drafts are a function of the tokens
        (deterministic, one-hot ``q``). Sampled requests use it in the rejection rule ``min(1, p/q)``.
    """

    token_ids: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None


@dataclass(frozen=True)
class ProposerCapabilities:
    """What a proposer declares. ``kvcore plugins`` lists it."""

    #: drafts are a function of the request's tokens (``Proposal.probs`` is always None)
    deterministic: bool = True
    #: runs a model of its own (loaded through :attr:`ProposerTarget.load_model`)
    needs_model: bool = False


@dataclass(frozen=True)
class ProposerTarget:
    """The engine a proposer is bound to (:meth:`Proposer.bind`).

    :param model: the target decoder (a draft may share its weights).
    :param load_model: ``load_model(spec, weights=None) -> (decoder, tokenizer)``: loads another model as kvcore
        loads any (``smollm2``, a .gguf file, a Hugging Face directory) in the target's dtype and device, with the
        target's weight format or ``weights`` (an ``EngineConfig.weights`` value).
    :param lm_head: the target's LM head as its runner calls it (``head(hidden [N, d]) -> logits [N, V]``, e.g. the
        int4 head with its top candidates rescored), None for the dense head: a draft that shares the target's
        weights computes its logits as the target does.
    """

    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    max_num_seqs: int
    model: Any = None
    tokenizer: Any = None
    load_model: Callable[..., tuple[Any, Any]] | None = None
    lm_head: Any = None


class Proposer(abc.ABC):
    """Guesses draft tokens for speculative decoding. Subclass it, declare ``name`` (and ``description``,
    ``capabilities``), implement :meth:`propose`, and register the class through the
    ``kvcore_register_proposers`` hook. Constructor keywords come from ``[proposers.<name>]``."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    capabilities: ClassVar[ProposerCapabilities] = ProposerCapabilities()

    def __init__(self, **options: Any) -> None:
        if options:
            raise unknown_options_error("proposer", self.name, "proposers", type(self), options)

    @classmethod
    def availability(cls) -> str | None:
        """``None`` when the proposer can run here, else a one-line reason. Must not raise."""
        return None

    def bind(self, target: ProposerTarget) -> list[str]:
        """Called once with the engine it serves, before any request; returns the reasons it cannot serve
        this target ([] = it can), e.g. a draft model whose tokenizer differs."""
        return []

    def start(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Request ``request_id`` begins decoding with these tokens (prompt + output so far)."""
        return None

    @abc.abstractmethod
    def propose(self, rows: Sequence[DraftRow], num_tokens: Sequence[int]) -> list[Proposal]:
        """One :class:`Proposal` per row, of at most ``num_tokens[i]`` tokens continuing
        ``rows[i].prompt_ids + rows[i].output_ids``. Ids must lie in the target's vocabulary.

        ``num_tokens[i]`` (>= 1) is the request's budget this step: ``num_speculative_tokens``, fewer where its
        drafts and the target's own token would pass ``max_new_tokens`` or the context limit, or not fit the
        step. It is a limit, not a hint: the engine does not cut a longer proposal, it fails that request with a
        :class:`~kvcore.errors.PluginError` naming the proposer and the reason, as it does for ids outside the
        vocabulary, ``token_ids`` that are not a list of ints, bad ``probs``, or a row whose tokens were changed.
        Returning anything but one Proposal per row, or raising, fails every row of the call."""

    def advance(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """The target kept ``num_accepted`` of the ``num_proposed`` drafts of the last proposal (and added one
        token of its own); e.g. to back off where guesses keep failing."""
        return None

    def finish(self, request_id: str) -> None:
        """Request ``request_id`` ended or left the cache: drop its state."""
        return None
