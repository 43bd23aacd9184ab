"""Render a :class:`~kvcore.conformance.results.SuiteReport` as text, Markdown or JSON."""

from __future__ import annotations

import json
from collections import Counter

from kvcore.conformance import tolerances
from kvcore.conformance.coverage import coverage_line
from kvcore.conformance.results import SuiteReport

__all__ = ["to_text", "to_markdown", "to_json", "TIER_TITLES"]

TIER_TITLES = {
    "op": "op level (attention vs reference)",
    "cache": "cache consistency (cached decode vs recompute)",
    "stream": "token streams (greedy vs reference)",
    "sampling": "sampling (seeded reproducibility)",
}


def _headline(r: SuiteReport) -> str:
    s = r.settings
    mode = "quick" if s.get("quick") else "full"
    if s.get("tensor_parallel_size", 1) > 1:
        mode += f", tensor-parallel size {s['tensor_parallel_size']}"
    return (
        f"kvcore conformance: backend '{r.backend}' ({r.environment.get('backend_class', '?')}), "
        f"KV cache {', '.join(s.get('kv_caches', []))}, sampler {s.get('sampler')}, "
        f"{', '.join(s.get('dtypes', [s.get('dtype')]))} on {s.get('device')}, {mode}, "
        f"models {', '.join(s.get('models', []))}"
    )


def _coverage(r: SuiteReport) -> list[str]:
    return [coverage_line(tier, cov) for tier, cov in r.settings.get("coverage", {}).items()]


def _verdict(r: SuiteReport) -> str:
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
    lines.append(f"{'tier':<10}{'status':<9}{'pass':>5}{'fail':>6}{'skip':>6}{'time':>9}")
    for tier in r.tiers:
        c = r.counts(tier)
        secs = sum(x.seconds for x in r.by_tier(tier))
        lines.append(f"{tier:<10}{r.tier_status(tier).upper():<9}{c['pass']:>5}{c['fail']:>6}{c['skip']:>6}"
                     f"{secs:>8.1f}s")
    if r.failures:
        lines += ["", "FAILURES"]
        for x in r.failures:
            lines.append(x.describe())
            if verbose and x.info.get("traceback"):
                lines.append("  " + x.info["traceback"].replace("\n", "\n  "))
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
    env = ", ".join(f"{k} {v}" for k, v in r.environment.items())
    out += [f"Environment: {env}", ""]
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
        for x in r.failures:
            out += [f"### [{x.tier}] {x.case}", "", x.detail, ""]
            if x.info.get("traceback"):
                out += ["```", x.info["traceback"].rstrip(), "```", ""]
    out += ["## Tolerances", "", "| dtype | op (atol, rtol) | cache logits (atol, rtol) | token streams |",
            "|---|---|---|---|"]
    for dtype, op in tolerances.OP.items():
        out.append(f"| {str(dtype).removeprefix('torch.')} | {op} | {tolerances.CACHE[dtype]} | "
                   f"{tolerances.STREAM[dtype]} |")
    out += ["", "## Cases", "", "| tier | case | status | max err | time | detail |", "|---|---|---|---:|---:|---|"]
    for x in r.results:
        err = "" if x.max_err is None else f"{x.max_err:.3g}"
        out.append(f"| {x.tier} | {x.case} | {x.status} | {err} | {x.seconds:.2f}s | {_md_escape(x.detail)} |")
    return "\n".join(out) + "\n"


def to_json(r: SuiteReport) -> str:
    return json.dumps(r.as_dict(), indent=2, default=str)
