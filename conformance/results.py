"""What a conformance run produces: one :class:`CaseResult` per case, grouped into a :class:`SuiteReport`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "PASS", "FAIL", "SKIP", "CaseResult", "SuiteReport", "EXIT_PASS", "EXIT_FAIL", "EXIT_USAGE", "EXIT_UNAVAILABLE",
    "EXIT_INTERRUPTED", "SCHEMA_VERSION",
]

PASS, FAIL, SKIP = "pass", "fail", "skip"

#: process exit codes of ``kvcore conformance``
EXIT_PASS = 0  # every case that ran passed (skips allowed)
EXIT_FAIL = 1  # at least one case failed, or the backend is broken (its import, availability() or constructor raised)
EXIT_USAGE = 2  # bad flags, unknown backend or model, bad configuration
EXIT_UNAVAILABLE = 3  # the backend cannot run here at all (or nothing could be tested): not a failure
EXIT_INTERRUPTED = 130  # Ctrl-C: the report holds the cases that finished (the shell's code for SIGINT)

#: version of the ``--json`` report's layout; raised when a key changes meaning or goes away
SCHEMA_VERSION = 2


@dataclass
class CaseResult:
    """Outcome of one case of one tier.

    ``detail`` is the one-paragraph diagnosis a human reads first (for a failure: where and by how much
    it diverged; for a skip: why). ``info`` holds the same facts machine-readably (shapes, step, tokens,
    margins) for ``--json``.
    """

    tier: str
    case: str
    status: str  # PASS / FAIL / SKIP
    detail: str = ""
    max_err: float | None = None
    tolerance: str | None = None
    seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == PASS

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    @property
    def skipped(self) -> bool:
        return self.status == SKIP

    def describe(self) -> str:
        """One block of text: ``[tier] case: STATUS`` then the detail."""
        head = f"[{self.tier}] {self.case}: {self.status.upper()}"
        return f"{head}\n  {self.detail}" if self.detail else head

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SuiteReport:
    """A whole run against one backend."""

    backend: str
    settings: dict[str, Any]
    tiers: list[str]
    results: list[CaseResult] = field(default_factory=list)
    unavailable: str | None = None  # reason the backend cannot run here at all
    #: the thing under test is broken before any case: its import, ``availability()`` or constructor raised
    #: (one line, then a traceback summary); a failure, never "unavailable"
    error: str | None = None
    seconds: float = 0.0
    environment: dict[str, Any] = field(default_factory=dict)
    interrupted: bool = False  # Ctrl-C stopped the run; ``results`` holds the cases that finished

    def by_tier(self, tier: str) -> list[CaseResult]:
        return [r for r in self.results if r.tier == tier]

    def counts(self, tier: str | None = None) -> dict[str, int]:
        rows = self.results if tier is None else self.by_tier(tier)
        return {s: sum(r.status == s for r in rows) for s in (PASS, FAIL, SKIP)}

    def tier_status(self, tier: str) -> str:
        """``pass`` / ``fail`` / ``skip`` (nothing ran) / ``unavailable`` for one tier."""
        if self.error:
            return FAIL
        if self.unavailable:
            return "unavailable"
        c = self.counts(tier)
        if c[FAIL]:
            return FAIL
        return PASS if c[PASS] else SKIP

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if r.failed]

    @property
    def status(self) -> str:
        if self.interrupted:
            return "interrupted"
        if self.error:
            return FAIL
        if self.unavailable:
            return "unavailable"
        c = self.counts()
        if c[FAIL]:
            return FAIL
        return PASS if c[PASS] else "untested"

    @property
    def exit_code(self) -> int:
        status = self.status
        if status == PASS:
            return EXIT_PASS
        if status == FAIL:
            return EXIT_FAIL
        if status == "interrupted":
            return EXIT_INTERRUPTED
        return EXIT_UNAVAILABLE  # unavailable, or every case skipped: nothing was proven

    def as_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "backend": self.backend,
            "status": self.status,
            "interrupted": self.interrupted,
            "exit_code": self.exit_code,
            "unavailable": self.unavailable,
            "error": self.error,
            "settings": self.settings,
            "environment": self.environment,
            "seconds": round(self.seconds, 3),
            "tiers": {
                t: {"status": self.tier_status(t), **self.counts(t)} for t in self.tiers
            },
            "results": [r.as_dict() for r in self.results],
        }
