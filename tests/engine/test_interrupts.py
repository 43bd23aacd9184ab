"""An exception or KeyboardInterrupt at any stage of Engine.step leaves every request untouched (same
stream as an uninterrupted run, every event delivered once) or cleanly failed, and no KV block leaked;
generate() and stream() interrupted leave nothing behind."""

from __future__ import annotations

import pytest

import kvcore.execution.runner
import kvcore.scheduling.scheduler
from kvcore import Engine, EngineConfig, FinishReason, SamplingParams

WORKLOAD = [
    ([1, 5, 9, 13, 17, 21, 25, 29, 33], SamplingParams(max_new_tokens=6, ignore_eos=True)),
    ([1, 5, 9, 13, 17, 21, 25, 29, 40, 41], SamplingParams(max_new_tokens=5, temperature=0.8, seed=3, logprobs=2)),
    ([7, 8, 9], SamplingParams(max_new_tokens=6, temperature=1.0, seed=5, n=2, ignore_eos=True)),
    ([2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26], SamplingParams(max_new_tokens=4, ignore_eos=True)),
]
CONFIG = dict(backend="paged", block_size=4, num_blocks=14, max_model_len=64, max_num_batched_tokens=8,
              enable_prefix_caching=True)


def drive(engine: Engine) -> tuple[dict, dict, int]:
    """Run WORKLOAD (a request joining every other step); an interrupted step is simply called again."""
    ids: list[str] = []
    events: dict[str, list[int]] = {}
    pending, calls, interrupted = list(WORKLOAD), 0, 0
    while pending or engine.has_unfinished():
        if pending and calls % 2 == 0:
            ids += engine.sample_ids(engine.add_request(*pending.pop(0)))
        calls += 1
        try:
            step_events = engine.step()
        except (KeyboardInterrupt, RuntimeError):
            interrupted += 1
            continue
        for e in step_events:
            events.setdefault(e.request_id, []).append(e.token_id)
    return {r: engine.release(r) for r in ids}, events, interrupted


@pytest.fixture(scope="module")
def baseline(random_model):
    results, events, _ = drive(Engine(random_model, None, EngineConfig(**CONFIG)))
    return {r: res.token_ids for r, res in results.items()}


STAGES = ["schedule", "reserve", "forward", "commit", "logprobs", "sample", "fork", "advance", "finish", "free"]


def stages(engine: Engine) -> dict[str, tuple[object, str]]:
    """Every stage of a step: (object, attribute) to wrap."""
    return {
        "schedule": (engine.scheduler, "schedule"),
        "reserve": (engine.kv, "reserve"),
        "forward": (kvcore.execution.runner, "last_token_logits"),  # what the step's runner calls
        "commit": (engine.kv.blocks, "commit"),
        "logprobs": (engine.sampler, "logprobs"),
        "sample": (engine.sampler, "sample"),
        "fork": (engine.scheduler, "fork"),
        "advance": (kvcore.scheduling.scheduler, "emit"),  # one sampled token into its request
        "finish": (engine.scheduler, "finish"),
        "free": (engine.kv, "free_sequence"),
    }


def inject(
    monkeypatch, owner, attr: str, nth: int, after: bool, exc: type[BaseException], times: int = 1
) -> list[int]:
    """Make ``owner.attr`` raise ``exc`` on its calls nth .. nth + times - 1 (before or after running)."""
    original = getattr(owner, attr)
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        hit = nth <= calls[0] < nth + times
        if hit and not after:
            raise exc("injected")
        out = original(*args, **kwargs)
        if hit and after:
            raise exc("injected")
        return out

    monkeypatch.setattr(owner, attr, wrapped)
    return calls


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("stage", STAGES)
def test_keyboard_interrupt_at_any_stage(random_model, baseline, monkeypatch, stage, after):
    for nth in (1, 4):
        engine = Engine(random_model, None, EngineConfig(**CONFIG))
        owner, attr = stages(engine)[stage]
        calls = inject(monkeypatch, owner, attr, nth, after, KeyboardInterrupt)
        results, events, interrupted = drive(engine)
        monkeypatch.undo()
        assert interrupted == (calls[0] >= nth), (stage, nth)
        assert {r: res.token_ids for r, res in results.items()} == baseline, (stage, nth)
        assert all(res.finish_reason in (FinishReason.LENGTH, FinishReason.EOS) for res in results.values())
        assert {r: events.get(r, []) for r in baseline} == baseline  # every token's event exactly once
        assert engine.kv.blocks.num_free_blocks == engine.kv.blocks.num_blocks, (stage, nth)
        assert not engine._requests and not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize("stage", ["schedule", "advance", "finish", "commit"])
def test_an_exception_outside_forward_and_sampler_is_recovered_too(random_model, baseline, monkeypatch, stage):
    engine = Engine(random_model, None, EngineConfig(**CONFIG))
    owner, attr = stages(engine)[stage]
    inject(monkeypatch, owner, attr, 3, False, RuntimeError)
    results, _, interrupted = drive(engine)
    assert interrupted == 1
    assert {r: res.token_ids for r, res in results.items()} == baseline
    assert engine.kv.blocks.num_free_blocks == engine.kv.blocks.num_blocks


def test_a_failing_forward_fails_its_requests_cleanly(random_model, baseline, monkeypatch):
    engine = Engine(random_model, None, EngineConfig(**CONFIG))
    # a mixed step fails, and so do both its per-phase retries
    inject(monkeypatch, kvcore.execution.runner, "last_token_logits", 3, False, RuntimeError, times=3)
    results, _, interrupted = drive(engine)
    assert interrupted == 0
    failed = [r for r in results.values() if r.finish_reason is FinishReason.ERROR]
    assert failed and all("injected" in str(r.error) for r in failed)
    assert all(r.token_ids == baseline[rid] for rid, r in results.items() if r not in failed)
    assert engine.kv.blocks.num_free_blocks == engine.kv.blocks.num_blocks


def test_interrupted_generate_and_stream_leave_nothing_behind(random_model, baseline, monkeypatch):
    engine = Engine(random_model, None, EngineConfig(**CONFIG))
    prompts, params = zip(*WORKLOAD)
    want = [baseline[r] for r in baseline]
    inject(monkeypatch, engine.kv, "reserve", 3, False, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, list(params))
    assert not engine._requests and not engine.has_unfinished()
    assert engine.kv.blocks.num_free_blocks == engine.kv.blocks.num_blocks
    monkeypatch.undo()
    assert [r.token_ids for r in engine.generate(prompts, list(params))] == want
    stream = engine.stream(*WORKLOAD[0])
    next(stream)
    stream.close()  # the caller stopped listening
    assert not engine._requests and engine.kv.blocks.num_free_blocks == engine.kv.blocks.num_blocks
    assert [e.token_id for e in engine.stream(*WORKLOAD[0])] == want[0]
