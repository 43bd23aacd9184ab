"""Smoke test of ``kvcore bench``'s code paths on the tiny model (no timing assertions).

The harness ships as the separate kvcore-bench package (benchmarks/, installed by ``make setup``) and adds
the command through its ``bench`` entry point in the ``kvcore`` group.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvcore.cli import main
from kvcore.plugins.registry import reset_registry
from kvcore_bench.bench import Bench
from kvcore_bench.cli import CASES
from kvcore_bench.report import render_markdown, write_outputs
from kvcore_bench.settings import BenchSettings

TINY = str(Path(__file__).parents[1] / "data" / "tiny-llama")


def tiny_settings(tmp_path, **kw) -> BenchSettings:
    base = dict(quick=True, model=TINY, out=str(tmp_path), reps=1, new_tokens=4, long_context=96,
                contexts=(16, 64), progress=False, transformers=False)
    base.update(kw)
    return BenchSettings(**base)


def test_every_case_runs_and_writes_outputs(tmp_path):
    report = Bench(tiny_settings(tmp_path)).run()
    sides = {(m["case"], m["side"]) for m in report["measurements"]}
    for case in ("decode", "long", "bf16", "batch"):
        for backend in ("naive", "sdpa", "paged"):
            assert (case, backend) in sides
    for m in report["measurements"]:
        assert m["decode_tok_s"] > 0 and m["ttft_s"] > 0 and m["kv_bytes_allocated"] > 0
    cap = report["capacity"]
    contiguous, paged = cap["caches"].values()
    # same byte budget, and the paged cache runs more of the mixed-length requests at once
    assert contiguous["kv_bytes_allocated"] <= cap["kv_budget_bytes"] >= paged["kv_bytes_allocated"]
    assert paged["max_concurrent"] > contiguous["max_concurrent"] == 4
    assert contiguous["errors"] == paged["errors"] == 0
    assert set(report["scaling"]) == {"naive", "sdpa", "paged"}
    assert {row["key"] for row in report["targets"]} >= {"decode", "ttft", "capacity", "scaling", "chunked"}
    spec = report["speculative"]["modes"]
    assert set(spec) == {"base", "ngram"} and spec["base"]["draft_tokens"] == 0
    assert 0 <= spec["ngram"]["acceptance_rate"] <= 1 and spec["ngram"]["decode_tok_s"] > 0
    assert spec["base"]["tokens_per_step"] == 1.0 and spec["ngram"]["tokens_per_step"] >= 1.0
    modes = report["chunked"]["modes"]
    assert set(modes) == {"whole", "chunked"} and all(m["worst_gap_cpu_s"] > 0 and m["long_ttft_s"] > 0
                                                      for m in modes.values())

    paths = write_outputs(report, tmp_path)
    names = {p.name for p in paths}
    assert {"results.md", "results.json"} <= names
    assert "| case |" in (tmp_path / "results.md").read_text()
    assert "tokens per decode step" in (tmp_path / "results.md").read_text()
    assert json.loads((tmp_path / "results.json").read_text())["settings"]["model"] == TINY


def test_greedy_tokens_match_transformers_on_the_same_weights(tmp_path):
    pytest.importorskip("transformers")
    report = Bench(tiny_settings(tmp_path, transformers=True, backends=("sdpa",), cases=("decode", "batch"))).run()
    sides = {(m["case"], m["side"]): m for m in report["measurements"]}
    assert ("decode", "transformers") in sides and ("batch", "transformers") in sides
    # fp32 greedy on the same weights: the engine and transformers' generate agree token for token
    assert sides[("decode", "sdpa")]["tokens_match_transformers"] is True
    assert sides[("batch", "sdpa")]["tokens_match_transformers"] is True
    md = render_markdown(report)
    assert "transformers" in md and "×" in md


def test_cli_bench_quick(tmp_path, capsys, bench_plugin):
    rc = main(["bench", "--quick", "--model", TINY, "--no-transformers", "--backends", "sdpa", "--cases",
               "decode,capacity", "--reps", "1", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "decode tok/s" in out and (tmp_path / "results.md").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cases", "nope"], "unknown bench case"),
        (["--backends", "no-such-backend"], "no-such-backend"),
        (["--reps", "0"], "--reps"),
    ],
)
def test_cli_bench_usage_errors_are_one_line(tmp_path, capsys, bench_plugin, argv, message):
    rc = main(["bench", "--model", TINY, "--no-transformers", "--out", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert rc != 0 and message in err and len(err.strip().splitlines()) == 1


def test_cases_constant_is_what_the_cli_accepts():
    assert CASES == ("decode", "long", "bf16", "batch", "capacity", "scaling", "chunked", "speculative")


def test_bench_is_not_part_of_the_runtime_package(capsys, monkeypatch):
    assert importlib.util.find_spec("kvcore.bench") is None
    monkeypatch.setenv("KVCORE_LOAD_PLUGINS", "")
    reset_registry()
    with pytest.raises(SystemExit):  # without the plugin, the runtime has no bench command
        main(["bench", "--help"])
    assert "invalid choice: 'bench'" in capsys.readouterr().err
