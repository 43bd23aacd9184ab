"""The executor seam: :class:`~kvcore.execution.runner.Executor` names every method the engine calls on its
runner, and both runners (one process, tensor-parallel) implement each with the protocol's parameters, the
verification forward included."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.execution.distributed.tp_runner import TensorParallelRunner
from kvcore.execution.runner import Executor, ModelRunner

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = {name for name, value in vars(Executor).items() if inspect.isfunction(value) and not name.startswith("_")}


def runner_calls(source: str) -> set[str]:
    """The attributes read off anything named ``runner`` (``self.runner.x``, ``engine.runner.x``, ``runner.x``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
            if name == "runner":
                found.add(node.attr)
    return found


def test_the_protocol_names_the_step_and_lifecycle_methods():
    assert PROTOCOL == {"start", "forward", "forward_positions", "describe", "failure", "close"}


@pytest.mark.parametrize("runner", [ModelRunner, TensorParallelRunner], ids=["one-process", "tensor-parallel"])
def test_each_runner_implements_every_protocol_method(runner):
    for name in sorted(PROTOCOL):
        method = getattr(runner, name, None)
        assert callable(method), f"{runner.__name__} has no {name}()"
        want = list(inspect.signature(getattr(Executor, name)).parameters)
        got = list(inspect.signature(method).parameters)
        assert got == want, f"{runner.__name__}.{name}{tuple(got)} is not the protocol's {tuple(want)}"


def test_nothing_outside_execution_calls_a_runner_method_the_protocol_lacks():
    used: dict[str, list[str]] = {}
    for path in sorted((ROOT / "kvcore").rglob("*.py")):
        if "execution" in path.relative_to(ROOT / "kvcore").parts:
            continue
        for attr in runner_calls(path.read_text()):
            used.setdefault(attr, []).append(str(path.relative_to(ROOT)))
    assert {"forward", "forward_positions", "start", "close"} <= set(used)  # the scan sees the engine's calls
    outside = {attr: paths for attr, paths in used.items() if attr not in PROTOCOL}
    assert not outside, f"runner methods outside the Executor protocol: {outside}"


def test_a_call_outside_the_protocol_is_seen():
    planted = "def step(engine):\n    engine.runner.forward(1)\n    return engine.runner.warm_up()\n"
    assert runner_calls(planted) - PROTOCOL == {"warm_up"}


def _verification_logits(model, config: EngineConfig) -> torch.Tensor:
    """The logits of a verification row ``[last token, two drafts]`` after a prefill, as ``config``'s runner
    scores them (the scheduler reserves the row with its drafts, as a speculative step does)."""
    engine = Engine(model, None, config)
    try:
        engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=8, ignore_eos=True))
        engine.step()  # the prefill: the request now decodes
        batch = engine.scheduler.schedule().batch
        verify = engine.scheduler.add_drafts(batch, [2])
        ids = [batch.requests[0].output_ids[-1], 11, 12]
        return engine.runner.forward_positions(engine.decode_backend, engine.kv.cache, engine.forward.metadata(verify),
                                               ids, [0], verify.query_lens, verify.copies)
    finally:
        engine.close()


def test_tensor_parallel_forward_positions_scores_what_one_process_does(random_model):
    one = _verification_logits(random_model, EngineConfig(backend="sdpa"))
    two = _verification_logits(random_model, EngineConfig(backend="sdpa", tensor_parallel_size=2))
    assert one.shape == (3, random_model.config.vocab_size)
    torch.testing.assert_close(two, one, rtol=1e-4, atol=1e-4)
