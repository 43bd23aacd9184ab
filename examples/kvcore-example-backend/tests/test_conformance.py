"""The kvcore conformance suite for this package's three plugins, by subclassing its base classes.

``BaseConformanceTests`` is every tier, the speculative one included: the backend's verification rows
(``multi_token_decode``) and the cache under speculation, whose logprobs are held to the tolerance the
cache's declared ``unit_roundoff`` implies.

Each class certifies one plugin; the ``backend`` fixture returns what is under test as a
:class:`~kvcore.conformance.target.Target` resolved in this package's own registry (the ``registry``
fixture of conftest.py), so the run does not depend on which entry points the environment loads.
"""

import pytest

from kvcore.conformance.base import BaseConformanceTests, BaseSamplingTests, BaseTokenStreamTests
from kvcore.conformance.target import resolve_target


class ExampleSuite(BaseConformanceTests):
    conformance_quick = True  # CI-sized; run `kvcore conformance ...` (README) before a release
    conformance_models = ("tiny",)


class TestExampleChunked(ExampleSuite):
    """The backend, over the canonical cache of each layout it reads (``contiguous``, ``paged``)."""

    @pytest.fixture
    def backend(self, registry):
        return resolve_target("example_chunked", registry)


class TestExampleFp16Cache(ExampleSuite):
    """The cache, read by the built-in backend kvcore picks for its layout ("paged"), held to the
    tolerance its declared ``unit_roundoff`` implies."""

    @pytest.fixture
    def backend(self, registry):
        return resolve_target(None, registry, kv_cache="example_fp16")


class TestExampleRepetitionPenalty(BaseTokenStreamTests, BaseSamplingTests):
    """The sampler, under kvcore's best built-in backend: only the tiers that run a sampler (greedy and
    seeded streams, whose reference streams use the same sampler on the reference backend)."""

    conformance_quick = True
    conformance_models = ("tiny",)

    @pytest.fixture
    def backend(self, registry):
        return resolve_target(None, registry, sampler="example_repetition_penalty")
