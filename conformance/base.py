"""Base test classes a backend author subclasses, pandas-extension-array style.

::

    # tests/test_conformance.py of your backend package
    import pytest
    from kvcore.conformance.base import BaseConformanceTests

    from my_package import MyBackend


    class TestMyBackend(BaseConformanceTests):
        @pytest.fixture
        def backend(self):
            return MyBackend  # or its registered name, "my_backend"

        conformance_quick = True  # optional: class attributes tune the run (None = pytest option/default)

Each tier is its own base class (:class:`BaseAttentionOpTests`, :class:`BaseCacheConsistencyTests`,
:class:`BaseTokenStreamTests`, :class:`BaseSamplingTests`, :class:`BaseSpeculativeTests`);
:class:`BaseConformanceTests` is all five.
Every case becomes one test id (``test_op[gqa8x2-d64-ragged]``). A case outside the backend's declared
capabilities is *skipped* with the reason; an unavailable backend skips everything with its reason.

Settings come from, first to last: the class attributes below, the ``--kvcore-*`` options of the
pytest plugin, then the suite defaults (float32, cpu, full case set, models tiny and smollm2).
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from kvcore.conformance.pytest_plugin import TARGET_OPTIONS
from kvcore.conformance.results import FAIL, SKIP, CaseResult
from kvcore.conformance.runner import run_case, tier_cases
from kvcore.conformance.settings import DEFAULT_MODELS, SuiteConfig
from kvcore.conformance.target import Target, parse_options, resolve_target
from kvcore.plugins.registry import PluginRegistry, get_registry

__all__ = [
    "BaseAttentionOpTests",
    "BaseCacheConsistencyTests",
    "BaseTokenStreamTests",
    "BaseSamplingTests",
    "BaseSpeculativeTests",
    "BaseConformanceTests",
    "proposer_under_test",
    "suite_config",
    "target_label",
]

#: parametrized argument name -> tier
_CASE_ARGS = {"op_case": "op", "cache_case": "cache", "stream_case": "stream", "sampling_case": "sampling",
              "speculative_case": "speculative"}


def _option(config: pytest.Config, name: str) -> Any:
    try:
        return config.getoption(name)
    except ValueError:  # the kvcore pytest plugin is disabled (-p no:kvcore)
        return None


def target_label(config: pytest.Config, owner: object | None = None) -> str:
    """The prefix of ``owner``'s test ids: its ``conformance_name``, else the ``--kvcore-backend`` /
    ``--kvcore-kv-cache`` / ``--kvcore-sampler`` / ``--kvcore-proposer`` names (``sdpa``, ``kv_cache=paged``),
    else the class name."""
    name = getattr(owner, "conformance_name", None)
    if name:
        return name
    named = [(prefix, _option(config, option)) for option, _, prefix in TARGET_OPTIONS]
    label = "+".join(f"{prefix}{value}" for prefix, value in named if value)
    return label or getattr(owner, "__name__", "conformance")


def _pick(config: pytest.Config, owner: object | None, attr: str, option: str, default: Any) -> Any:
    """``owner``'s class attribute ``attr``, else the pytest option, else ``default``."""
    value = getattr(owner, attr, None) if owner is not None else None
    if value is None:
        value = _option(config, option)
    return default if value is None else value


def proposer_under_test(config: pytest.Config, owner: object | None = None) -> str | None:
    """The speculative-decoding proposer ``owner`` certifies: its ``conformance_proposer``, else
    ``--kvcore-proposer``, else None. A class attribute, not a fixture: its cases are collected before any
    fixture runs."""
    return _pick(config, owner, "conformance_proposer", "kvcore_proposer", None)


def suite_config(config: pytest.Config, owner: object | None = None) -> SuiteConfig:
    """The :class:`SuiteConfig` for ``owner`` (a test class or instance) under this pytest run."""

    models = _pick(config, owner, "conformance_models", "kvcore_model", None)
    if isinstance(models, str):
        models = [models]
    models = tuple(m.strip() for item in (models or ()) for m in item.split(",") if m.strip()) or DEFAULT_MODELS
    return SuiteConfig(
        dtype=_pick(config, owner, "conformance_dtype", "kvcore_dtype", None),
        device=_pick(config, owner, "conformance_device", "kvcore_device", "cpu"),
        quick=bool(_pick(config, owner, "conformance_quick", "kvcore_quick", False)),
        models=models,
        attention_variants=tuple(getattr(owner, "conformance_attention_variants", None) or ()),
    )


class _ConformanceBase:
    #: ``None`` = take the ``--kvcore-*`` option, then the default
    conformance_dtype: ClassVar[str | None] = None
    conformance_device: ClassVar[str | None] = None
    conformance_quick: ClassVar[bool | None] = None
    conformance_models: ClassVar[tuple[str, ...] | None] = None
    #: torch CPU threads while this class's tests run (1: fastest on a small shared machine; 0 = leave as is)
    conformance_threads: ClassVar[int | None] = None
    #: what test ids start with (``test_op[NAME-gqa8x2-d64-ragged]``), so two certified plugins never share an
    #: id on a CI dashboard; ``None``: the ``--kvcore-*`` target names, else the class name
    conformance_name: ClassVar[str | None] = None
    #: a registered proposer to certify: its greedy and sampled cases join the speculative tier's; ``None``:
    #: ``--kvcore-proposer``, else the built-in test proposers only
    conformance_proposer: ClassVar[str | None] = None
    #: registered attention variants the run selects (``--attention-variant``): op cases whose layers carry each,
    #: and the stream and sampling tiers' engines attending with them
    conformance_attention_variants: ClassVar[tuple[str, ...]] = ()

    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def _conformance_threads(cls, request):
        threads = getattr(cls, "conformance_threads", None)
        if threads is None:
            threads = _option(request.config, "kvcore_threads")
        threads = 1 if threads is None else threads
        before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        yield
        torch.set_num_threads(before)

    @pytest.fixture
    def backend(self, request, kv_cache, sampler):
        """The backend under test: a registered name, ``module:Class``, or an AttentionBackend subclass
        (``None`` with a ``kv_cache``: a backend that reads its layout). Override this fixture; the default
        reads ``--kvcore-backend``."""
        name = _option(request.config, "kvcore_backend")
        if not name and not kv_cache and not sampler and not proposer_under_test(request.config, self):
            pytest.skip("nothing under test: override the `backend` (or `kv_cache`, `sampler`) fixture, set "
                        "`conformance_proposer`, or pass --kvcore-backend / --kvcore-kv-cache / --kvcore-sampler / "
                        "--kvcore-proposer NAME")
        return name

    @pytest.fixture
    def kv_cache(self, request) -> str | None:
        """The KV cache under test (a registered name), or None. Override it; the default reads
        ``--kvcore-kv-cache``."""
        return _option(request.config, "kvcore_kv_cache")

    @pytest.fixture
    def sampler(self, request) -> str | None:
        """The sampler under test (a registered name), or None. Override it; the default reads
        ``--kvcore-sampler``."""
        return _option(request.config, "kvcore_sampler")

    @pytest.fixture
    def backend_options(self, request) -> dict[str, Any]:
        """Constructor options of the backend under test. Override it; the default reads
        ``--kvcore-backend-option KEY=VALUE``."""
        return parse_options(_option(request.config, "kvcore_backend_option"), "--kvcore-backend-option")

    @pytest.fixture
    def kv_cache_options(self, request) -> dict[str, Any]:
        """Constructor options of the KV cache under test (``--kvcore-kv-cache-option``)."""
        return parse_options(_option(request.config, "kvcore_kv_cache_option"), "--kvcore-kv-cache-option")

    @pytest.fixture
    def sampler_options(self, request) -> dict[str, Any]:
        """Constructor options of the sampler under test (``--kvcore-sampler-option``)."""
        return parse_options(_option(request.config, "kvcore_sampler_option"), "--kvcore-sampler-option")

    @pytest.fixture
    def conformance_config(self, request) -> SuiteConfig:
        return suite_config(request.config, self)

    @pytest.fixture
    def conformance_target(
        self, request, backend, kv_cache, sampler, backend_options, kv_cache_options, sampler_options
    ) -> Target:
        """What the tests run against. A backend that is unavailable skips every test with its reason; one
        whose ``availability()`` or constructor raises fails them (an error in pytest's terms)."""
        if isinstance(backend, Target):
            target = backend
        else:
            target = resolve_target(backend, options=backend_options, kv_cache=kv_cache,
                                    kv_cache_options=kv_cache_options, sampler=sampler,
                                    sampler_options=sampler_options,
                                    proposer=proposer_under_test(request.config, self))
        reason = target.availability()
        if reason:
            pytest.skip(f"backend '{target.name}' is unavailable: {reason}")
        target.preflight()
        return target

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        label = target_label(metafunc.config, metafunc.cls)
        for arg, tier in _CASE_ARGS.items():
            if arg in metafunc.fixturenames:
                cfg = suite_config(metafunc.config, metafunc.cls)
                cases = tier_cases(_NoTarget(proposer_under_test(metafunc.config, metafunc.cls)), tier, cfg)
                metafunc.parametrize(arg, cases, ids=[f"{label}-{c.id}" for c in cases])

    @staticmethod
    def _assert_result(result: CaseResult) -> None:
        if result.status == SKIP:
            pytest.skip(result.detail)
        if result.status == FAIL:
            pytest.fail(result.describe(), pytrace=False)


class _NoTarget:
    """Stands in for the backend at collection time (case lists do not depend on it there)."""

    class capabilities:  # noqa: N801 - mimics BackendCapabilities
        kv_layouts: tuple[str, ...] = ()

    kv_cache = None

    def __init__(self, proposer: str | None) -> None:
        self.proposer = proposer  # the speculative tier's cases include the proposer under test's

    @staticmethod
    def cache_names() -> tuple[str, ...]:
        return ()

    @property
    def registry(self) -> PluginRegistry:  # where the variants a run selects are found (installed plugins)
        return get_registry()


class BaseAttentionOpTests(_ConformanceBase):
    """Op tier: attention output vs the reference over the case matrix (every declared cache kind)."""

    def test_op(self, conformance_target: Target, conformance_config: SuiteConfig, op_case) -> None:
        import dataclasses

        names = conformance_target.cache_names()
        variants = [op_case] if len(names) < 2 else [dataclasses.replace(op_case, kv_cache=n) for n in names]
        results = [run_case(conformance_target, "op", case, conformance_config) for case in variants]
        failed = [r for r in results if r.status == FAIL]
        if failed:
            pytest.fail("\n".join(r.describe() for r in failed), pytrace=False)
        if all(r.status == SKIP for r in results):
            pytest.skip(results[0].detail)


class BaseCacheConsistencyTests(_ConformanceBase):
    """Cache tier: prefill + cached decode logits == full recomputation logits, every step."""

    def test_cache(self, conformance_target: Target, conformance_config: SuiteConfig, cache_case) -> None:
        self._assert_result(run_case(conformance_target, "cache", cache_case, conformance_config))


class BaseTokenStreamTests(_ConformanceBase):
    """Stream tier: greedy streams through the engine vs the reference backend."""

    def test_stream(self, conformance_target: Target, conformance_config: SuiteConfig, stream_case) -> None:
        self._assert_result(run_case(conformance_target, "stream", stream_case, conformance_config))


class BaseSamplingTests(_ConformanceBase):
    """Sampling tier: seeded streams reproducible, and equal to the reference's in float32."""

    def test_sampling(self, conformance_target: Target, conformance_config: SuiteConfig, sampling_case) -> None:
        self._assert_result(run_case(conformance_target, "sampling", sampling_case, conformance_config))


class BaseSpeculativeTests(_ConformanceBase):
    """Speculative tier: streams with drafts (the built-in test proposers, and ``conformance_proposer``'s) ==
    streams without; skipped with the reason for a backend that does not declare multi-token decode."""

    def test_speculative(self, conformance_target: Target, conformance_config: SuiteConfig, speculative_case) -> None:
        self._assert_result(run_case(conformance_target, "speculative", speculative_case, conformance_config))


class BaseConformanceTests(
    BaseAttentionOpTests, BaseCacheConsistencyTests, BaseTokenStreamTests, BaseSamplingTests, BaseSpeculativeTests
):
    """Every tier, in run order."""

    test_op = BaseAttentionOpTests.test_op
    test_cache = BaseCacheConsistencyTests.test_cache
    test_stream = BaseTokenStreamTests.test_stream
    test_sampling = BaseSamplingTests.test_sampling
    test_speculative = BaseSpeculativeTests.test_speculative
