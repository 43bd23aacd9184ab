"""Every case ends: an engine run may take a number of steps proportional to the tokens it asks for, and a case
may run :attr:`~kvcore.conformance.settings.SuiteConfig.case_timeout` seconds. Past either, the case fails
with ``timed out after N s / N steps`` and the next case runs.

Both are checked between engine steps (:func:`generate`, :func:`steps`), so a plugin that makes the engine
loop (a proposer whose drafts grow a sequence past its limits, a scheduler that never finishes a request)
fails its case instead of hanging the suite. A single call that never returns (a stuck kernel) cannot be
interrupted from Python: the time limit fires at the next step.

:func:`case_limits` arms the limits for one case (:func:`kvcore.conformance.runner.run_case` does); outside
it (a tier's ``check`` called on its own) every engine run gets the default limits, its clock starting at
that run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI reads the default at start-up: this module imports nothing heavy
    from kvcore.interfaces.sampler import SamplingParams

__all__ = ["CaseTimeout", "CaseClock", "case_limits", "generate", "steps", "step_budget", "DEFAULT_CASE_TIMEOUT",
           "STEPS_PER_TOKEN", "STEP_SLACK"]

#: seconds a case may run by default: ten times the slowest built-in case under heavy load (a compiled stream)
DEFAULT_CASE_TIMEOUT = 600.0
#: an engine run may take this many steps per token it asks for (prompt + max_new_tokens, per sample), plus
#: :data:`STEP_SLACK`: a step computes at least one token of some request; preemption recomputes a few more
STEPS_PER_TOKEN = 4
STEP_SLACK = 64


class CaseTimeout(Exception):
    """A case ran past its step or time limit; the message says which and how far it got."""


@dataclass
class CaseClock:
    """The limits of one case: ``timeout`` seconds from ``start`` (None: none), ``max_steps`` per engine run
    (None: :func:`step_budget` of the run)."""

    timeout: float | None = DEFAULT_CASE_TIMEOUT
    max_steps: int | None = None
    start: float = field(default_factory=time.perf_counter)
    num_steps: int = 0  # engine steps of every run of the case so far

    def check(self, run_steps: int, run_limit: int) -> None:
        """Raise :class:`CaseTimeout` once the run took ``run_limit`` steps or the case its time."""
        elapsed = time.perf_counter() - self.start
        if run_steps >= run_limit:
            raise CaseTimeout(f"timed out after {elapsed:.1f} s / {self.num_steps} steps: an engine run reached "
                              f"its limit of {run_limit} steps without finishing its requests")
        if self.timeout is not None and elapsed > self.timeout:
            raise CaseTimeout(f"timed out after {elapsed:.1f} s / {self.num_steps} steps: past the limit of "
                              f"{self.timeout:g} s per case (--case-timeout)")


_CLOCK: ContextVar[CaseClock | None] = ContextVar("kvcore_conformance_case_clock", default=None)


@contextmanager
def case_limits(timeout: float | None, max_steps: int | None) -> Iterator[CaseClock]:
    """Arm the limits of one case (its clock starts now) for the engine runs inside."""
    clock = CaseClock(timeout, max_steps)
    token = _CLOCK.set(clock)
    try:
        yield clock
    finally:
        _CLOCK.reset(token)


def step_budget(num_tokens: int, max_steps: int | None = None) -> int:
    """Steps an engine run asking for ``num_tokens`` tokens may take (``max_steps`` when given)."""
    return max_steps if max_steps is not None else STEPS_PER_TOKEN * num_tokens + STEP_SLACK


def steps(num_tokens: int) -> Iterator[int]:
    """Step numbers 0, 1, ... for a loop of engine steps that asks for ``num_tokens`` tokens, checking the
    case's limits before each: ``run = steps(n)``, then ``next(run)`` before every ``engine.step()``."""
    clock = _CLOCK.get() or CaseClock()
    limit = step_budget(num_tokens, clock.max_steps)
    run_steps = 0
    while True:
        clock.check(run_steps, limit)
        yield run_steps
        run_steps += 1
        clock.num_steps += 1


def generate(engine, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> list:
    """``engine.generate(prompts, params)`` (token-id prompts, one params each) within the case's limits; past
    them its requests are aborted and released, and :class:`CaseTimeout` is raised."""
    ids: list[str] = []
    try:
        for prompt, p in zip(prompts, params, strict=True):
            ids += engine.sample_ids(engine.add_request(list(prompt), p))
        run = steps(sum(p.n * (len(prompt) + p.max_new_tokens) for prompt, p in zip(prompts, params)))
        while not all(engine.is_finished(r) for r in ids):
            next(run)
            engine.step()
    except BaseException:
        for rid in ids:
            engine.abort(rid)
            engine.release(rid)
        raise
    return [engine.release(r) for r in ids]
