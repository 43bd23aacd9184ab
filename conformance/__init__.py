"""Conformance suite (installed as kvcore.conformance): the release gate for any attention backend.

Run it as ``kvcore conformance --backend NAME``, as ``pytest --kvcore-backend NAME`` (the pytest11
plugin), or subclass :mod:`kvcore.conformance.base`'s test classes. From Python::

    from kvcore.conformance import SuiteConfig, run_suite

    report = run_suite("sdpa", SuiteConfig(quick=True))
    assert report.exit_code == 0, report.failures

See ``docs/conformance.md``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_suite", "SuiteConfig", "SuiteReport", "CaseResult"]


def __getattr__(name: str) -> Any:  # lazy: the pytest plugin imports this package in every pytest run
    if name == "run_suite":
        from kvcore.conformance.runner import run_suite

        return run_suite
    if name == "SuiteConfig":
        from kvcore.conformance.settings import SuiteConfig

        return SuiteConfig
    if name in ("SuiteReport", "CaseResult"):
        from kvcore.conformance import results

        return getattr(results, name)
    raise AttributeError(f"module 'kvcore.conformance' has no attribute {name!r}")
