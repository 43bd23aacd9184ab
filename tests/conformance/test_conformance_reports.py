"""Reports people can act on: failure summaries, --verbose, atomic JSON (also on Ctrl-C), versions, the
kernel build announced before the first case."""

from __future__ import annotations

import json

import kvcore
from kvcore.cli import main
from kvcore.conformance import runner
from kvcore.conformance.coverage import case_dimensions, coverage_line, tier_coverage
from kvcore.conformance.report import failure_summary, to_text
from kvcore.conformance.results import EXIT_INTERRUPTED, FAIL, PASS, SCHEMA_VERSION, CaseResult, SuiteReport
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.speculative_tier import SpecCase

QUICK = ["--quick", "--model", "tiny", "--dtype", "float32"]


def _report(n_fail: int, n_pass: int) -> SuiteReport:
    results = [CaseResult("op", f"gqa-{i}", FAIL, detail=f"call 2/5 (decode; seqs [0]) layer 0: off {i}",
                          info={"dimensions": {"heads": "8/2", "dtype": "float32"}}) for i in range(n_fail)]
    results += [CaseResult("op", f"mha-{i}", PASS, info={"dimensions": {"heads": "8/8", "dtype": "float32"}})
                for i in range(n_pass)]
    settings = {"dtypes": ["float32"], "device": "cpu", "models": ["tiny"], "kv_caches": ["contiguous"]}
    return SuiteReport(backend="x", settings=settings, tiers=["op"], results=results)


def test_summary_groups_failures_by_what_they_share():
    line = failure_summary(_report(5, 4), "op")
    assert line == "op: 5 of 9 failed. heads 8/2: every case fails; 8/8: every case passes; failing calls: decode 5"
    assert failure_summary(_report(0, 4), "op") is None


def test_only_a_few_failures_in_full_without_verbose():
    report = _report(5, 4)
    short, full = to_text(report), to_text(report, verbose=True)
    assert "off 2" in short and "off 3" not in short and "... and 2 more failures (-v lists them all)" in short
    assert all(f"off {i}" in full for i in range(5))


def test_the_tier_table_keeps_a_long_tier_name_apart_from_its_status():
    report = _report(0, 2)
    report.tiers = ["op", "speculative"]
    report.results.append(CaseResult("speculative", "accept-all", PASS))
    rows = [line.split() for line in to_text(report).splitlines() if line.startswith(("op ", "speculative "))]
    assert [row[:3] for row in rows] == [["op", "PASS", "2"], ["speculative", "PASS", "1"]]


def test_json_file_is_whole_when_interrupted(tmp_path, monkeypatch, capsys):
    calls = []
    real = runner.run_case

    def interrupting(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "run_case", interrupting)
    out = tmp_path / "report.json"
    rc = main(["conformance", "--backend", "sdpa", *QUICK, "--tier", "sampling", "--no-progress", "--json", str(out)])
    assert rc == EXIT_INTERRUPTED
    data = json.loads(out.read_text())
    assert data["interrupted"] is True and data["status"] == "interrupted" and len(data["results"]) == 2
    assert data["schema_version"] == SCHEMA_VERSION and data["environment"]["kvcore"] == kvcore.__version__
    assert "INTERRUPTED (exit 130)" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temporary file left behind


def test_json_names_each_component_with_its_distribution(capsys):
    rc = main(["conformance", "--sampler", "default", *QUICK, "--tier", "sampling", "--no-progress", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    sampler = data["environment"]["under_test"]["sampler"]
    assert sampler["name"] == "default" and sampler["distribution"] == "kvcore"
    assert sampler["version"] == kvcore.__version__


def test_kernel_build_is_announced_before_the_first_case(monkeypatch, capsys):
    built = []
    monkeypatch.setattr(runner, "kernel_reasons", lambda: [])
    monkeypatch.setattr(runner, "kernels_built", lambda: bool(built))
    monkeypatch.setattr(runner, "load_kernels", lambda: built.append(1))
    rc = main(["conformance", "--backend", "sdpa", *QUICK, "--tier", "sampling"])
    err = capsys.readouterr().err
    assert rc == 0 and built == [1]
    assert err.index("building kvcore's C++ CPU kernels") < err.index("[sampling")


def test_speculative_coverage_names_its_model_variants_and_proposers():
    cases = [SpecCase("conformance-oracle", "greedy"), SpecCase("conformance-random", "distribution"),
             SpecCase("mine", "sampled")]
    cov = tier_coverage("speculative", cases, SuiteConfig())
    assert cov == {"cases": 3, "dtypes": ["float32"], "models": ["tiny"],
                   "proposers": ["conformance-oracle", "conformance-random", "mine"],
                   "variants": ["distribution", "greedy", "sampled"]}
    assert coverage_line("speculative", cov) == (
        "speculative: 3 cases; float32; models tiny; variants distribution, greedy, sampled; "
        "proposers conformance-oracle, conformance-random, mine")
    assert case_dimensions(cases[2], SuiteConfig())["proposer"] == "mine"
