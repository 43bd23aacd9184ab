"""Render a :class:`~kvcore.conformance.results.SuiteReport` as text, Markdown or JSON."""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections import Counter
from pathlib import Path

from kvcore.conformance import tolerances
from kvcore.conformance.coverage import coverage_line
from kvcore.conformance.results import SuiteReport
from kvcore.interfaces.dtypes import dtype_name

__all__ = ["to_text", "to_markdown", "to_json", "TIER_TITLES", "failure_summary", "write_json"]

#: failures printed in full per tier without --verbose (the summary line groups them all)
SHOWN_FAILURES = 3

TIER_TITLES = {
    "op": "op level (attention vs reference)",
    "cache": "cache consistency (cached decode vs recompute)",
    "stream": "token streams (greedy vs reference)",
    "sampling": "sampling (draws vs reference, seeded reproducibility)",
}

_PHASE = re.compile(r"^call \d+/\d+ \(([^;)]+)")


def _phase(result) -> str | None:
    """The phase of the call a failure happened in (op: the call's kind; cache: prefill or decode)."""
    m = _PHASE.match(result.detail)
    if m:
        return m.group(1)
    step = result.info.get("step")
    if result.tier == "cache" and isinstance(step, int):
        return "prefill" if step == 0 else "decode"
    return None


def _few(values: list[str], shown: int = 6) -> str:
    more = f" and {len(values) - shown} more" if len(values) > shown else ""
    return ", ".join(values[:shown]) + more


def failure_summary(r: SuiteReport, tier: str) -> str | None:
    """One line saying what a tier's failures have in common: per dimension, the values every case with which
    failed against the values every case with which passed (``phase``: where the failing calls were)."""
    ran = [x for x in r.by_tier(tier) if not x.skipped]
    failed = [x for x in ran if x.failed]
    if not failed:
        return None
    table: dict[str, dict[str, list[int]]] = {}  # dimension -> value -> [failed, ran]
    for x in ran:
        for dim, value in x.info.get("dimensions", {}).items():
            counts = table.setdefault(dim, {}).setdefault(value, [0, 0])
            counts[0] += x.failed
            counts[1] += 1
    parts = []
    for dim, values in table.items():
        always = [v for v, (f, n) in values.items() if f == n]
        never = [v for v, (f, n) in values.items() if f == 0]
        if always and never:
            parts.append(f"{dim} {_few(always)}: every case fails; {_few(never)}: every case passes")
    phases = Counter(p for p in map(_phase, failed) if p)
    if phases:
        parts.append("failing calls: " + ", ".join(f"{p} {n}" for p, n in phases.most_common()))
    if len(failed) == len(ran):
        parts.insert(0, "every case fails")
    common = "; ".join(parts) if parts else "no dimension separates failing from passing cases"
    return f"{tier}: {len(failed)} of {len(ran)} failed. {common}"


def _headline(r: SuiteReport) -> str:
    s = r.settings
    mode = "quick" if s.get("quick") else "full"
    if s.get("tensor_parallel_size", 1) > 1:
        mode += f", tensor-parallel size {s['tensor_parallel_size']}"
    if s.get("attention_variants"):
        mode += f", attention variants {', '.join(s['attention_variants'])}"
    return (
        f"kvcore conformance: backend '{r.backend}' ({r.environment.get('backend_class', '?')}), "
        f"KV cache {', '.join(s.get('kv_caches', []))}, sampler {s.get('sampler')}, "
        f"{', '.join(s.get('dtypes', [s.get('dtype')]))} on {s.get('device')}, {mode}, "
        f"models {', '.join(s.get('models', []))}"
    )


def _coverage(r: SuiteReport) -> list[str]:
    return [coverage_line(tier, cov) for tier, cov in r.settings.get("coverage", {}).items()]


def _verdict(r: SuiteReport) -> str:
    if r.interrupted:
        c = r.counts()
        return (f"INTERRUPTED (exit {r.exit_code}): {c['pass']} passed, {c['fail']} failed, {c['skip']} skipped "
                f"before Ctrl-C")
    if r.error:
        return f"FAIL (exit {r.exit_code}): {r.error.splitlines()[0]}"
    if r.status == "unavailable":
        return f"UNAVAILABLE (exit {r.exit_code}): {r.unavailable}"
    if r.status == "untested":
        return f"UNTESTED (exit {r.exit_code}): every case was skipped; nothing was proven"
    c = r.counts()
    word = "PASS" if r.status == "pass" else "FAIL"
    counts = f"{c['pass']} passed, {c['fail']} failed, {c['skip']} skipped"
    return f"{word} (exit {r.exit_code}): {counts} in {r.seconds:.1f}s"


def _skip_summary(r: SuiteReport) -> list[tuple[str, str, int]]:
    counts = Counter((x.tier, x.detail) for x in r.results if x.skipped)
    return [(tier, why, n) for (tier, why), n in counts.items()]


def to_text(r: SuiteReport, verbose: bool = False) -> str:
    lines = [_headline(r)]
    if r.error:
        lines.append(f"{r.backend} is broken: " + r.error.replace("\n", "\n  "))
        lines.append(f"RESULT: {_verdict(r)}")
        return "\n".join(lines)
    if r.unavailable:
        lines.append(f"backend '{r.backend}' is unavailable here: {r.unavailable}")
        lines.append(f"RESULT: {_verdict(r)}")
        return "\n".join(lines)
    cov = _coverage(r)
    if cov:
        lines += ["covers:"] + [f"  {line}" for line in cov]
    lines.append("")
    width = max([10, *(len(tier) + 2 for tier in r.tiers)])  # "speculative" is wider than the others
    lines.append(f"{'tier':<{width}}{'status':<9}{'pass':>5}{'fail':>6}{'skip':>6}{'time':>9}")
    for tier in r.tiers:
        c = r.counts(tier)
        secs = sum(x.seconds for x in r.by_tier(tier))
        lines.append(f"{tier:<{width}}{r.tier_status(tier).upper():<9}{c['pass']:>5}{c['fail']:>6}{c['skip']:>6}"
                     f"{secs:>8.1f}s")
    if r.failures:
        lines += ["", "FAILURES"]
        lines += [line for tier in r.tiers if (line := failure_summary(r, tier))]
        for tier in r.tiers:
            failed = [x for x in r.failures if x.tier == tier]
            for x in failed if verbose else failed[:SHOWN_FAILURES]:
                lines.append(x.describe())
                if verbose and x.info.get("traceback"):
                    lines.append("  " + x.info["traceback"].replace("\n", "\n  "))
            if not verbose and len(failed) > SHOWN_FAILURES:
                lines.append(f"[{tier}] ... and {len(failed) - SHOWN_FAILURES} more failures (-v lists them all)")
    skips = _skip_summary(r)
    if skips:
        lines += ["", "SKIPPED"]
        lines += [f"[{tier}] {n} case(s): {why}" for tier, why, n in skips]
    if verbose:
        lines += ["", "ALL CASES"]
        lines += [f"[{x.tier}] {x.case}: {x.status} ({x.seconds:.2f}s) {x.detail}" for x in r.results]
    lines += ["", f"RESULT: {_verdict(r)}"]
    return "\n".join(lines)


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(r: SuiteReport) -> str:
    out = [f"# Conformance report: `{r.backend}`", "", _headline(r), "", f"**Result: {_verdict(r)}**", ""]
    env = ", ".join(f"{k} {v}" for k, v in r.environment.items() if k != "under_test")
    out += [f"Environment: {env}", ""]
    for kind, c in r.environment.get("under_test", {}).items():
        dist = f"{c['distribution']} {c['version']}" if c.get("distribution") else "no installed distribution"
        out.append(f"* {kind} `{c['name']}`: `{c['class']}` (plugin {c['plugin']}, {dist})")
    out.append("")
    if r.error:
        out += ["```", r.error, "```", ""]
    if r.unavailable or r.error:
        return "\n".join(out) + "\n"
    cov = _coverage(r)
    if cov:
        out += ["## Coverage", ""] + [f"* {_md_escape(line)}" for line in cov] + [""]
    out += ["## Tiers", "", "| tier | status | pass | fail | skip | time |", "|---|---|---:|---:|---:|---:|"]
    for tier in r.tiers:
        c = r.counts(tier)
        secs = sum(x.seconds for x in r.by_tier(tier))
        out.append(f"| {TIER_TITLES.get(tier, tier)} | {r.tier_status(tier)} | {c['pass']} | {c['fail']} | "
                   f"{c['skip']} | {secs:.1f}s |")
    out.append("")
    if r.failures:
        out += ["## Failures", ""]
        out += [f"* {_md_escape(line)}" for tier in r.tiers if (line := failure_summary(r, tier))] + [""]
        for x in r.failures:
            out += [f"### [{x.tier}] {x.case}", "", x.detail, ""]
            if x.info.get("traceback"):
                out += ["```", x.info["traceback"].rstrip(), "```", ""]
    out += ["## Tolerances", "", "| dtype | op (atol, rtol) | cache logits (atol, rtol) | token streams |",
            "|---|---|---|---|"]
    for dtype, op in tolerances.OP.items():
        out.append(f"| {dtype_name(dtype)} | {op} | {tolerances.CACHE[dtype]} | "
                   f"{tolerances.STREAM[dtype]} |")
    out += ["", "## Cases", "", "| tier | case | status | max err | time | detail |", "|---|---|---|---:|---:|---|"]
    for x in r.results:
        err = "" if x.max_err is None else f"{x.max_err:.3g}"
        out.append(f"| {x.tier} | {x.case} | {x.status} | {err} | {x.seconds:.2f}s | {_md_escape(x.detail)} |")
    return "\n".join(out) + "\n"


def to_json(r: SuiteReport) -> str:
    data = r.as_dict()
    data["summary"] = {t: line for t in r.tiers if (line := failure_summary(r, t))}
    return json.dumps(data, indent=2, default=str)


def write_json(r: SuiteReport, path: str) -> None:
    """Write the JSON report to ``path`` atomically: a temporary file in the same folder, then a rename, so
    the file is the whole report or absent (never half written, even when the run was interrupted)."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent if str(target.parent) else ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(to_json(r) + "\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
