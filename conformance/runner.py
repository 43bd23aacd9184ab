"""Run the tiers against one backend and collect a :class:`~kvcore.conformance.results.SuiteReport`."""

from __future__ import annotations

import importlib.metadata
import platform
import sys
import time
import traceback
from collections.abc import Callable
from types import ModuleType

import torch

from kvcore.conformance import cache_tier, op_tier, sampling_tier, speculative_tier, stream_tier
from kvcore.conformance.coverage import case_dimensions, tier_coverage
from kvcore.conformance.limits import CaseTimeout, case_limits
from kvcore.conformance.results import FAIL, PASS, SKIP, CaseResult, SuiteReport
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import BrokenTargetError, Target, resolve_target
from kvcore.errors import BackendUnavailableError
from kvcore.interfaces.attention import AttentionBackend
from kvcore.kernels.cpu_kernels import kernel_reasons, kernels_built, load_kernels
from kvcore.plugins.registry import PluginRegistry
from kvcore.version import __version__

__all__ = ["TIER_MODULES", "run_suite", "tier_cases", "run_case", "stderr_progress", "stderr_notice",
           "prepare_kernels"]

TIER_MODULES: dict[str, ModuleType] = {
    op_tier.NAME: op_tier,
    cache_tier.NAME: cache_tier,
    stream_tier.NAME: stream_tier,
    sampling_tier.NAME: sampling_tier,
    speculative_tier.NAME: speculative_tier,
}

Progress = Callable[[str, int, int, object, CaseResult | None], None]
Notice = Callable[[str], None]


def tier_cases(target: Target, tier: str, cfg: SuiteConfig) -> list:
    return TIER_MODULES[tier].cases(target, cfg)


def run_case(target: Target, tier: str, case, cfg: SuiteConfig) -> CaseResult:
    """Run one case of ``tier``: the one runner every tier shares. A tier module provides
    ``tolerance(target, case, cfg) -> str``, ``skip_reasons(target, case, cfg) -> list[str]`` (a case
    outside the declared capabilities is skipped with the reasons) and ``check(target, case, cfg, result)``,
    which sets ``result`` (``info["where"]`` says what it was doing). An exception is a failure with its
    location and traceback, never a suite crash; so is a case past its step or time limit
    (:mod:`kvcore.conformance.limits`: ``timed out after N s / N steps``), after which the next case runs."""
    module = TIER_MODULES[tier]
    cfg = cfg.for_dtype(getattr(case, "dtype", None))
    start = time.perf_counter()
    result = CaseResult(tier=tier, case=case.id, status=PASS, tolerance=module.tolerance(target, case, cfg))
    result.info["dimensions"] = case_dimensions(case, cfg)
    try:
        reasons = module.skip_reasons(target, case, cfg)
        if reasons:
            result.status, result.detail = SKIP, "; ".join(reasons)
        else:
            with case_limits(cfg.case_timeout, cfg.max_steps):
                module.check(target, case, cfg, result)
    except CaseTimeout as exc:  # the next case runs; a traceback would only show the engine loop
        result.status = FAIL
        result.detail = f"case '{case.id}' {exc} ({result.info.get('where', 'setup')})"
        result.info["timed_out"] = True
    except Exception as exc:
        result.status = FAIL
        tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
        result.detail = f"{result.info.get('where', 'setup')}: raised {type(exc).__name__}: {exc}"
        result.info["traceback"] = "".join(tb[-6:])
    result.info.pop("where", None)
    result.seconds = time.perf_counter() - start
    return result


def stderr_progress(tier: str, index: int, total: int, case, result: CaseResult | None) -> None:
    """One line per case on stderr: ``[op  3/36] mha8x8-d128-ragged ... pass (0.31s)``."""
    if result is None:
        print(f"[{tier:<8} {index:>3}/{total}] {case.id} ...", end="", file=sys.stderr, flush=True)
    else:
        print(f" {result.status} ({result.seconds:.2f}s)", file=sys.stderr, flush=True)


def stderr_notice(message: str) -> None:
    print(f"kvcore conformance: {message}", file=sys.stderr, flush=True)


def prepare_kernels(cfg: SuiteConfig, notice: Notice | None) -> str:
    """Build kvcore's C++ CPU kernels before the first case when they are not built yet, saying so (a build
    inside a case would be silent and be counted as that case's time). Returns what the report records."""
    if cfg.torch_device.type != "cpu":
        return "not used (device is not cpu)"
    reasons = kernel_reasons()
    if reasons:
        return "unavailable: " + "; ".join(reasons)
    if kernels_built():
        return "built"
    if notice:
        notice("building kvcore's C++ CPU kernels (once per machine and torch version) ...")
    start = time.perf_counter()
    try:
        load_kernels()
    except BackendUnavailableError as exc:
        if notice:
            notice(f"kernel build failed: {exc}")
        return f"build failed: {exc}"
    if notice:
        notice(f"kernels built in {time.perf_counter() - start:.0f}s")
    return "built now"


def _distribution(cls: type) -> dict:
    """The installed distribution (name and version) that ships ``cls``'s top-level package, if any."""
    top = cls.__module__.split(".")[0]
    names = importlib.metadata.packages_distributions().get(top) or []
    if not names:
        return {"distribution": None, "version": None}
    return {"distribution": names[0], "version": importlib.metadata.version(names[0])}


def _component(cls: type, name: str, entry) -> dict:
    return {"name": name, "class": f"{cls.__module__}.{cls.__qualname__}",
            "plugin": entry.plugin if entry is not None else None, **_distribution(cls)}


def environment(target: Target) -> dict:
    """Versions and where each thing under test comes from (plugin, distribution name and version)."""
    entry = target.registry.backends.get(target.name)
    components = {"backend": _component(target.cls, target.name, entry)}
    if target.kv_cache:
        components["kv_cache"] = _component(target.cache_class(target.kv_cache), target.kv_cache,
                                            target.registry.kv_caches.get(target.kv_cache))
    sampler = target.sampler or "default"
    sampler_entry = target.registry.samplers.get(sampler)
    if sampler_entry is not None:
        components["sampler"] = _component(sampler_entry.cls, sampler, sampler_entry)
    return {
        "kvcore": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "backend_class": components["backend"]["class"],
        "plugin": components["backend"]["plugin"],
        "under_test": components,
    }


def run_suite(
    backend: str | type[AttentionBackend] | Target,
    cfg: SuiteConfig | None = None,
    *,
    registry: PluginRegistry | None = None,
    progress: Progress | None = None,
    notice: Notice | None = None,
) -> SuiteReport:
    """Run every tier of ``cfg`` against ``backend`` (a name, ``module:Class``, a class, or a Target).

    An unavailable backend gives a report with ``unavailable`` set and no cases; a broken one (its
    ``availability()`` or constructor raised) a report with ``error`` set (a failure); Ctrl-C during the cases
    a report of the cases that finished with ``interrupted`` set. ``notice`` gets one-line announcements
    (the kernel build before the first case). Unknown names raise
    :class:`~kvcore.errors.UnknownBackendError` / :class:`~kvcore.errors.ConfigError`.
    """
    cfg = cfg or SuiteConfig()
    target = backend if isinstance(backend, Target) else resolve_target(backend, registry)
    settings = {**cfg.as_dict(), "kv_caches": list(target.cache_names()), "sampler": target.sampler or "default"}
    report = SuiteReport(backend=target.name, settings=settings, tiers=list(cfg.tiers))
    report.environment = environment(target)
    report.environment["kernels"] = prepare_kernels(cfg, notice)
    start = time.perf_counter()
    try:
        reason = target.availability()
        if not reason:
            target.preflight()
    except BrokenTargetError as exc:
        report.error = f"{exc}\n{exc.summary}" if exc.summary else str(exc)
        return report
    if reason:
        report.unavailable = reason
        return report
    try:
        for tier in cfg.tiers:
            cases = tier_cases(target, tier, cfg)
            report.settings.setdefault("coverage", {})[tier] = tier_coverage(tier, cases, cfg, target.cache_names())
            for i, case in enumerate(cases, 1):
                if progress:
                    progress(tier, i, len(cases), case, None)
                result = run_case(target, tier, case, cfg)
                report.results.append(result)
                if progress:
                    progress(tier, i, len(cases), case, result)
    except KeyboardInterrupt:  # Ctrl-C: the cases so far are still a report (and the JSON a complete one)
        report.interrupted = True
    report.seconds = time.perf_counter() - start
    return report
