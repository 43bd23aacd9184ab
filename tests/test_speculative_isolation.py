"""Speculation and the request lifecycle: a proposer's mistakes stay with the request they concern, its
lifecycle calls come in order, sequence limits hold with n > 1, and the counters count what was emitted."""

from __future__ import annotations

from helpers import make_plugin

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.plugins.registry import PluginRegistry
from kvcore.scheduling.scheduler import Scheduler

PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [10, 11]]


def registry_with(*proposers) -> PluginRegistry:
    reg = PluginRegistry(load_entrypoints=False)
    reg.register_plugin(make_plugin(proposers=list(proposers)), "test-proposers")
    return reg


def engine(model, proposer=None, registry=None, **config) -> Engine:
    config = {"backend": "sdpa", "dtype": "float32", "max_model_len": 64, "num_speculative_tokens": 3, **config}
    return Engine(model, None, EngineConfig(proposer=proposer, **config), registry=registry)


def reference(model, prompts, params):
    return [r.token_ids for r in engine(model).generate(prompts, params)]


def test_admission_counts_the_samples_an_admitted_request_will_fork(random_model, monkeypatch):
    """An n = 2 request admitted first occupies two sequences: the request behind it waits, so that no step
    runs more than max_num_seqs (the draft model's cache has exactly that many)."""
    peak = [0]
    schedule = Scheduler.schedule

    def spy(self):
        out = schedule(self)
        peak[0] = max(peak[0], len(self.running))
        return out

    monkeypatch.setattr(Scheduler, "schedule", spy)
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True, n=2, temperature=0.7, seed=3),
              SamplingParams(max_new_tokens=12, ignore_eos=True)]
    for backend, proposer in (("paged", None), ("paged", "draft"), ("sdpa", "draft")):
        peak[0] = 0
        out = engine(random_model, proposer, backend=backend, max_num_seqs=2).generate(PROMPTS[:2], params)
        assert [r.error for r in out] == [None] * 3 and [len(r.token_ids) for r in out] == [12] * 3
        assert peak[0] == 2, (backend, proposer)
