"""Faults stay small and health tells the truth: a NaN in one request's decode row fails that request only,
and ``/health`` answers 503 when the engine loop is dead, a tensor-parallel rank has ended, or a step has
run past the watchdog (over loopback)."""

from __future__ import annotations

import gc
import http.client
import json
import os
import signal
import threading
import time
import weakref

import pytest
import torch

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.backends.sdpa import SDPABackend
from kvcore.errors import BackendOutputError, ConfigError
from kvcore.execution.backend_check import BackendGuard
from kvcore.scheduling.request import FinishReason
from kvcore.serving import AsyncEngine, build_app
from kvcore.serving.server import ServerThread

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
PROMPTS = [[3 + i] * (3 + i) for i in range(6)]  # six lengths: every sequence has its own context length
TARGET = 2  # the request whose decode row turns NaN, in the fourth decode step
NTH_DECODE = 4


class NaNOnce(SDPABackend):
    """sdpa; in the ``NTH_DECODE``-th decode forward, the row of the sequence at context ``at`` is NaN."""

    name = "nan-once"

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.num_decodes, self.done, self._row = at, 0, False, None

    def plan(self, meta, cache):
        self._row = None
        self.num_decodes += meta.is_decode
        if meta.is_decode and self.num_decodes == NTH_DECODE:
            self._row, self.done = meta.context_lens.index(self.at), True
        return super().plan(meta, cache)

    def forward(self, layer_idx, q, k, v, cache, plan):
        out = super().forward(layer_idx, q, k, v, cache, plan)
        if self._row is not None and layer_idx == 0:
            out = out.clone()
            out[self._row] = float("nan")  # decode: token i is sequence i
        return out


def test_a_nan_decode_row_fails_only_its_request(random_model):
    alone = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=64))
    expected = [alone.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    engine = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=64, max_num_seqs=6))
    backend = NaNOnce(at=len(PROMPTS[TARGET]) + NTH_DECODE - 1)
    engine.decode_backend = backend
    engine.runner.guards[id(backend)] = BackendGuard(backend)
    results = engine.generate(PROMPTS, GREEDY)
    assert backend.done
    for i, res in enumerate(results):
        if i == TARGET:
            assert res.finish_reason is FinishReason.ERROR and isinstance(res.error, BackendOutputError)
            assert "NaN or inf" in str(res.error) and "of 6 in the batch" in str(res.error)
            assert res.token_ids == expected[i][:NTH_DECODE]  # the prefill's and 3 decodes', then the broken one
        else:
            assert res.error is None and res.token_ids == expected[i], i
    assert engine.kv.blocks.num_tokens_in_use == 0


def test_a_failed_requests_error_is_freed_with_its_result(random_model):
    """The error a failed request carries holds no reference cycle (its traceback's frames hold the batch, the
    request and the error itself): it goes with the result, not at some later run of the cyclic collector.
    A soak of NaN requests grew the server's memory by each batch's logits and activations otherwise."""
    engine = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=64, max_num_seqs=6))
    backend = NaNOnce(at=len(PROMPTS[TARGET]) + NTH_DECODE - 1)
    engine.decode_backend = backend
    engine.runner.guards[id(backend)] = BackendGuard(backend)
    gc.collect()
    gc.disable()
    try:
        results = engine.generate(PROMPTS, GREEDY)
        assert isinstance(results[TARGET].error, BackendOutputError)
        error = weakref.ref(results[TARGET].error)
        del results
        assert error() is None, gc.get_referrers(error())
    finally:
        gc.enable()


# -- /health --------------------------------------------------------------------------------------------

def health(srv) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    return resp.status, body


def wait_for(predicate, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_health_is_503_while_a_step_runs_past_the_watchdog(random_model):
    engine = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=64))
    release = threading.Event()
    real_step = engine.step

    def stalled_step():
        release.wait(20)  # a plugin stuck in a forward
        return real_step()

    engine.step = stalled_step
    front = AsyncEngine(engine, step_watchdog_s=0.3)
    with ServerThread(build_app(front, model_name="m")) as srv:
        assert health(srv)[0] == 200
        engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))  # loop thread idle: it picks it up
        with front._cv:
            front._cv.notify()
        status, body = wait_for(lambda: (r := health(srv))[0] == 503 and r)
        assert body["error"]["code"] == "engine_unavailable" and "past the watchdog limit of 0.3 s" in \
            body["error"]["message"]
        release.set()
        wait_for(lambda: health(srv)[0] == 200)  # the step ended: healthy again


def test_health_is_503_when_the_engine_loop_is_dead(random_model):
    engine = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=64))

    def dying_step():
        raise SystemExit("the loop thread dies")  # not an Exception: escapes the step's own handling

    engine.step = dying_step
    front = AsyncEngine(engine)
    with ServerThread(build_app(front, model_name="m")) as srv:
        engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
        with front._cv:
            front._cv.notify()
        status, body = wait_for(lambda: (r := health(srv))[0] == 503 and r)
        assert "the engine failed and stopped serving" in body["error"]["message"]


def test_the_watchdog_must_be_positive(random_model):
    engine = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=64))
    with pytest.raises(ConfigError, match="step_watchdog_s"):
        AsyncEngine(engine, step_watchdog_s=0)


def test_health_is_503_after_a_tensor_parallel_worker_is_killed(random_model):
    torch.set_num_threads(1)
    engine = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=64, tensor_parallel_size=2))
    front = AsyncEngine(engine)
    try:
        with ServerThread(build_app(front, model_name="m")) as srv:
            assert health(srv)[0] == 200
            (worker,) = engine.runner._state.procs
            os.kill(worker.pid, signal.SIGKILL)
            status, body = wait_for(lambda: (r := health(srv))[0] == 503 and r)
            assert f"tensor-parallel rank 1 (pid {worker.pid}) has ended" in body["error"]["message"]
    finally:
        engine.close()


def test_the_reference_check_interval_is_configurable(random_model):
    engine = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=64, backend_check_interval=7))
    assert {g.verify_every for g in engine.runner.guards.values()} == {7}
    with pytest.raises(ConfigError, match="backend_check_interval"):
        EngineConfig(backend_check_interval=0)


# -- stale K/V rows -------------------------------------------------------------------------------------

SHORT, LONG = [5, 9, 4, 7, 3], [11 + i % 17 for i in range(20)]  # a ragged decode batch: 5 and 20 tokens
POISON = [3 + i % 23 for i in range(40)]  # longer than both: its rows reach past what either writes


@pytest.mark.parametrize("backend, kv_cache", [("naive", None), ("sdpa", None), ("cpu_decode", None),
                                               ("paged", None), ("paged", "int8")])
def test_nan_rows_a_failed_request_left_behind_reach_no_later_request(random_model, monkeypatch, backend, kv_cache):
    config = EngineConfig(backend=backend, kv_cache=kv_cache, max_model_len=64, max_num_seqs=2)
    alone = Engine(random_model, None, config)
    expected = [alone.generate([p], GREEDY)[0].token_ids for p in (SHORT, LONG)]
    engine = Engine(random_model, None, config)
    prefill, real_forward = engine.prefill_backend, engine.prefill_backend.forward

    def nan_kv(layer_idx, q, k, v, cache, plan):  # a request whose keys and values went bad
        return real_forward(layer_idx, q, torch.full_like(k, float("nan")), torch.full_like(v, float("nan")),
                            cache, plan)

    monkeypatch.setattr(prefill, "forward", nan_kv)
    (failed,) = engine.generate([POISON], GREEDY)
    assert failed.finish_reason is FinishReason.ERROR and engine.kv.blocks.num_tokens_in_use == 0
    monkeypatch.setattr(prefill, "forward", real_forward)
    # SHORT takes the failed request's slot (contiguous) or reads its blocks as padding (paged)
    results = engine.generate([SHORT, LONG], GREEDY)
    assert [r.error for r in results] == [None, None]
    assert [r.token_ids for r in results] == expected
