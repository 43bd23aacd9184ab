"""Every conformance case ends: a case whose engine loops fails as timed out (naming the case, the steps and the
seconds) within its step or time limit, and a proposer that made the engine loop fails its case by name."""

from __future__ import annotations

import time

import pytest
from helpers import make_plugin

from kvcore import Engine
from kvcore.conformance import speculative_tier as tier
from kvcore.conformance.limits import STEP_SLACK, STEPS_PER_TOKEN, step_budget
from kvcore.conformance.results import FAIL
from kvcore.conformance.runner import run_case
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import resolve_target
from kvcore.errors import ConfigError
from kvcore.interfaces.proposer import Proposal, Proposer
from kvcore.plugins.registry import PluginRegistry
from kvcore.scheduling.batch import SchedulerOutput
from kvcore.scheduling.scheduler import Scheduler

#: engine steps after which a test gives up on the suite under test stopping a case by itself (so that a
#: suite without limits fails the test instead of hanging CI)
HANG_GUARD = 3000


class Writer(Proposer):
    """Writes its drafts into the requests it is shown instead of returning them: each grows past its limits."""

    name = "writer"

    def propose(self, rows, num_tokens):
        for row in rows:
            row.output_ids.extend([1] * 100)
        return [Proposal() for _ in rows]


@pytest.fixture
def hang_guard(monkeypatch):
    """Engine steps are counted; past HANG_GUARD the step raises: the suite did not stop the case itself."""
    count = [0]
    step = Engine.step

    def guarded(self):
        count[0] += 1
        if count[0] > HANG_GUARD:
            raise RuntimeError(f"hang guard: still stepping after {HANG_GUARD} steps, the suite set no limit")
        return step(self)

    monkeypatch.setattr(Engine, "step", guarded)
    return count


@pytest.fixture
def target():
    reg = PluginRegistry()
    name = reg.register_plugin(make_plugin(proposers=[Writer]), "writer")
    try:
        yield resolve_target("sdpa", registry=reg, proposer="writer")
    finally:
        reg.unregister_plugin(name)


def run(target, case_id: str, **cfg):
    proposer, variant = case_id.rsplit("-", 1)
    case = tier.SpecCase({"oracle": "conformance-oracle"}.get(proposer, proposer), variant)
    assert case.id == case_id
    config = SuiteConfig(dtype="float32", models=("tiny",), tiers=("speculative",), **cfg)
    start = time.perf_counter()
    result = run_case(target, "speculative", case, config)
    return result, time.perf_counter() - start


def test_a_proposer_that_made_the_engine_loop_fails_its_case_naming_the_proposer(target, hang_guard):
    result, seconds = run(target, "writer-greedy", max_steps=200)
    assert result.status == FAIL, result.detail
    assert "proposer 'writer' changed request" in result.detail, result.detail
    assert seconds < 60 and hang_guard[0] < 400


def stuck(monkeypatch) -> None:
    """A scheduler that never schedules anything again once speculation is on: the engine loops, emitting nothing."""
    schedule = Scheduler.schedule

    def never(self):
        return SchedulerOutput() if getattr(self, "_stuck", False) else schedule(self)

    monkeypatch.setattr(Scheduler, "schedule", never)
    make = tier._engine

    def engine(target, cm, proposer, *args, **kwargs):
        eng = make(target, cm, proposer, *args, **kwargs)
        eng.scheduler._stuck = proposer is not None
        return eng

    monkeypatch.setattr(tier, "_engine", engine)


def test_a_case_past_its_step_limit_fails_as_timed_out_and_names_the_case(target, hang_guard, monkeypatch):
    stuck(monkeypatch)
    result, seconds = run(target, "oracle-greedy", max_steps=200)  # the run without speculation takes < 100
    assert result.status == FAIL and result.info.get("timed_out"), result.detail
    assert result.detail.startswith("case 'oracle-greedy' timed out after "), result.detail
    assert "steps: an engine run reached its limit of 200 steps" in result.detail, result.detail
    assert result.detail.endswith("(generation with proposer 'conformance-oracle')")  # what it was doing
    assert seconds < 60 and hang_guard[0] <= 300


def test_a_case_past_its_time_limit_fails_as_timed_out(target, hang_guard, monkeypatch):
    stuck(monkeypatch)
    step = Engine.step
    monkeypatch.setattr(Engine, "step", lambda self: (time.sleep(0.02), step(self))[1])
    result, seconds = run(target, "oracle-greedy", case_timeout=0.5)
    assert result.status == FAIL and result.info.get("timed_out"), result.detail
    assert "past the limit of 0.5 s per case (--case-timeout)" in result.detail, result.detail
    assert seconds < 30


def test_the_default_step_budget_is_a_generous_multiple_of_the_tokens_asked_for():
    assert step_budget(100) == STEPS_PER_TOKEN * 100 + STEP_SLACK >= 2 * 100
    assert step_budget(100, max_steps=7) == 7


@pytest.mark.parametrize("bad", [{"case_timeout": 0}, {"case_timeout": -1.0}, {"case_timeout": "1"},
                                 {"max_steps": 0}, {"max_steps": 2.5}, {"max_steps": True}])
def test_limits_are_validated(bad):
    with pytest.raises(ConfigError, match=next(iter(bad))):
        SuiteConfig(**bad)
    assert SuiteConfig(case_timeout=None, max_steps=10).as_dict()["max_steps"] == 10
