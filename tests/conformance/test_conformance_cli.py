"""``kvcore conformance`` (exit codes, outputs) and the ``kvcore`` pytest plugin (via pytester)."""

from __future__ import annotations

import json

import pytest
import torch

from kvcore.cli import main

pytest_plugins = ["pytester"]

TINY_QUICK = ["--quick", "--model", "tiny", "--no-progress"]


@pytest.fixture(autouse=True, scope="module")
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# -- CLI -----------------------------------------------------------------------------------------------
def test_pass_exits_0_with_per_tier_summary(capsys, tmp_path):
    report = tmp_path / "report.md"
    rc = main(["conformance", "--backend", "sdpa", *TINY_QUICK, "--tier", "op,cache", "--report", str(report),
               "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "RESULT: PASS (exit 0)" in out
    for tier in ("op", "cache"):
        assert f"\n{tier} " in out
    md = report.read_text()
    assert md.startswith("# Conformance report: `sdpa`") and "| op level" in md and "## Cases" in md
    # the header says what each tier covered
    assert "covers:" in out and "GQA groups 1, 2, 3, 4, 5, 6, 8, MQA" in out and "block_size 1, 8, 12, 16" in out
    assert "## Coverage" in md and "head_dim 32, 40, 64, 72, 80, 96, 112, 128, 256" in md


def test_json_output_and_progress_on_stderr(capsys):
    rc = main(["conformance", "--backend", "naive", "--quick", "--model", "tiny", "--tier", "sampling", "--json"])
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert rc == 0 and data["status"] == "pass" and data["exit_code"] == 0
    assert set(data["tiers"]) == {"sampling"}
    assert data["settings"]["quick"] is True and data["settings"]["models"] == ["tiny"]
    assert data["settings"]["coverage"]["sampling"]["dtypes"] == ["float32", "bfloat16", "float16"]
    assert "[sampling" in captured.err and "pass" in captured.err  # progress goes to stderr


def test_planted_bug_exits_1_and_names_tier_case_and_error(capsys):
    rc = main(["conformance", "--backend", "test_conformance_planted:GQAHeadMapping", *TINY_QUICK,
               "--tier", "op,stream", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "[op] gqa8x2-d32-ragged" in out and "max |err|" in out and "H=8 H_kv=2 D=32" in out
    assert "[stream] tiny-" in out and "diverges from the reference at step" in out
    assert "RESULT: FAIL (exit 1)" in out


def test_unavailable_backend_exits_3(capsys):
    from kvcore.plugins.registry import get_registry

    if "flash_attn2" not in get_registry().backends or get_registry().backends["flash_attn2"].availability() is None:
        pytest.skip("flash_attn2 is not registered, or can run here")
    rc = main(["conformance", "--backend", "flash_attn2", *TINY_QUICK])
    out = capsys.readouterr().out
    assert rc == 3
    assert "unavailable here:" in out and "RESULT: UNAVAILABLE (exit 3)" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--backend", "no_such_backend"], "unknown backend 'no_such_backend'"),
        (["--backend", "sdpa", "--dtype", "int7"], "unknown dtype 'int7'"),
        (["--backend", "sdpa", "--tier", "speed"], "unknown tier(s) speed"),
        (["--backend", "sdpa", "--device", "nosuchdevice"], "unknown device"),
        (["--backend", "sdpa", "--threads", "-1"], "--threads"),
        (["--backend", "sdpa", "--backend-option", "novalue"], "KEY=VALUE"),
    ],
)
def test_usage_errors_exit_2_with_one_line(capsys, argv, message):
    rc = main(["conformance", *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and err.count("\n") == 1


def test_backend_options_reach_the_backend(capsys):
    rc = main(["conformance", "--backend", "paged", "--kv-cache", "paged", "--kv-cache-option", "block_size=8",
               *TINY_QUICK, "--tier", "cache", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["status"] == "pass"
    rc = main(["conformance", "--kv-cache", "paged", "--kv-cache-option", "block_size=0", *TINY_QUICK])
    assert rc == 1 and "block_size must be a positive integer" in capsys.readouterr().out
    rc = main(["conformance", "--backend", "paged", "--backend-option", "bogus=1", *TINY_QUICK])
    assert rc == 2 and "got unknown options: bogus" in capsys.readouterr().err


def test_missing_backend_flag_is_a_usage_error(capsys):
    assert main(["conformance"]) == 2
    err = capsys.readouterr().err
    assert "give --backend, --kv-cache, --sampler or --proposer" in err and err.count("\n") == 1


# -- pytest plugin -------------------------------------------------------------------------------------
PLUGIN_ARGS = ["--kvcore-quick", "--kvcore-model", "tiny", "-p", "no:cacheprovider"]


def test_plugin_runs_the_bundled_suite(pytester):
    from kvcore.conformance.attention_cases import variant_cases
    from kvcore.conformance.cases import op_cases
    from kvcore.conformance.settings import ALL_DTYPES

    result = pytester.runpytest("--kvcore-backend", "paged", *PLUGIN_ARGS, "-k", "test_op and mha8x8 or test_cache",
                                "-v", "--junitxml", "junit.xml")
    num_op = sum("mha8x8" in c.id for c in op_cases(quick=True, dtypes=ALL_DTYPES) + variant_cases())
    # cache tier: 3 variants and the cache driven directly, per dtype; the poisoned slots in float32
    result.assert_outcomes(passed=num_op + 4 * len(ALL_DTYPES) + 1)
    result.stdout.fnmatch_lines(["*TestConformance::test_op[[]paged-mha8x8-d32-ragged[]] PASSED*",
                                 "*TestConformance::test_cache[[]paged-tiny-chunked[]] PASSED*"])
    junit = (pytester.path / "junit.xml").read_text()
    assert 'name="test_op[paged-mha8x8-d32-ragged]"' in junit  # two certified plugins never share an id


def test_bundled_suite_ids_name_its_file(pytester):
    """Run from another project (the suite outside the rootdir), ids used to begin with an empty path
    (``::TestConformance::test_op[...]``)."""
    for target in (["--kvcore-backend", "paged"], ["--kvcore-proposer", "ngram"]):
        result = pytester.runpytest(*target, *PLUGIN_ARGS, "--collect-only", "-q")
        ids = [line for line in result.outlines if "::" in line]
        assert ids and all(i.startswith("kvcore/conformance/suite.py::TestConformance::test_") for i in ids), ids[:3]


def test_plugin_adds_nothing_without_the_option(pytester):
    pytester.makepyfile("def test_plain():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_plugin_reports_unavailable_backend_as_skips(pytester):
    pytester.makepyfile(
        """
        import pytest, torch
        from kvcore import AttentionBackend, BackendCapabilities
        from kvcore.conformance.base import BaseCacheConsistencyTests

        class Gone(AttentionBackend):
            name = "gone"
            capabilities = BackendCapabilities(devices=frozenset({"cuda"}), dtypes=frozenset({torch.float16}),
                                               kv_layouts=("contiguous",))
            @classmethod
            def availability(cls):
                return "no CUDA device"
            def forward(self, *a):
                raise AssertionError

        class TestGone(BaseCacheConsistencyTests):
            conformance_quick = True
            conformance_models = ("tiny",)

            @pytest.fixture
            def backend(self):
                return Gone
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs")
    # (3 variants + the cache driven directly) x float32, bfloat16, float16, and the poisoned slots
    result.assert_outcomes(skipped=13)
    result.stdout.fnmatch_lines(["*backend 'gone' is unavailable: no CUDA device*"])


def test_subclassed_base_classes_fail_a_planted_bug(pytester):
    pytester.makepyfile(
        """
        import pytest
        from kvcore.conformance.base import BaseAttentionOpTests
        from kvcore.backends.sdpa import SDPABackend

        class OffByOneScale(SDPABackend):
            name = "off_by_one_scale"
            def forward(self, layer_idx, q, k, v, cache, plan):
                import dataclasses
                meta = dataclasses.replace(plan.meta, scale=plan.meta.scale * 1.01)
                return super().forward(layer_idx, q, k, v, cache, dataclasses.replace(plan, meta=meta))

        class TestGood(BaseAttentionOpTests):
            conformance_quick = True
            conformance_dtype = "float32"
            @pytest.fixture
            def backend(self):
                return "sdpa"

        class TestBad(BaseAttentionOpTests):
            conformance_quick = True
            conformance_dtype = "float32"
            @pytest.fixture
            def backend(self):
                return OffByOneScale
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "--kvcore-threads", "1", "-v", "-k", "ragged")
    outcomes = result.parseoutcomes()
    from kvcore.conformance.attention_cases import variant_cases
    from kvcore.conformance.cases import op_cases

    plain = sum("ragged" in c.id for c in op_cases(quick=True))
    # the variant cases give every layer its own spec (scale included), which the planted meta.scale misses
    with_specs = sum("ragged" in c.id and not c.variants for c in variant_cases())
    as_code = sum("ragged" in c.id and bool(c.variants) for c in variant_cases())  # sdpa: skipped, no variants as code
    assert (outcomes["failed"], outcomes["passed"], outcomes["skipped"]) == (plain, plain + 2 * with_specs, 2 * as_code)
    result.stdout.fnmatch_lines(["*TestGood::test_op[[]TestGood-gqa8x2-d64-ragged[]] PASSED*",
                                 "*TestBad::test_op[[]TestBad-gqa8x2-d64-ragged[]] FAILED*",
                                 "*[[]op[]] gqa8x2-d64-ragged: FAIL*",
                                 "*max |err|*Shapes: H=8 H_kv=2 D=64*"])


# -- broken backends are failures, not "unavailable" ------------------------------------------------------
_BROKEN = '''
import torch
from kvcore.backends.sdpa import SDPABackend

if {raise_at_import!r}:
    raise RuntimeError("cannot find libattn.so")


class RaisingAvailability(SDPABackend):
    name = "raising_availability"

    @classmethod
    def availability(cls):
        raise OSError("probing the GPU failed")


class RaisingConstructor(SDPABackend):
    name = "raising_constructor"

    def __init__(self, **options):
        raise RuntimeError("workspace allocation failed")
'''


@pytest.fixture
def broken_module(tmp_path, monkeypatch):
    def make(name: str, raise_at_import: bool = False) -> str:
        (tmp_path / f"{name}.py").write_text(_BROKEN.format(raise_at_import=raise_at_import))
        return name

    monkeypatch.syspath_prepend(str(tmp_path))
    return make


@pytest.mark.parametrize("cls, message", [
    ("RaisingAvailability", "availability() raised OSError: probing the GPU failed"),
    ("RaisingConstructor", "constructor raised RuntimeError: workspace allocation failed"),
])
def test_backend_raising_in_availability_or_constructor_exits_1(capsys, broken_module, cls, message):
    module = broken_module(f"kvcore_broken_{cls.lower()}")
    rc = main(["conformance", "--backend", f"{module}:{cls}", *TINY_QUICK])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert message in out and "RESULT: FAIL (exit 1)" in out
    assert "Traceback" in out or 'File "' in out  # the traceback summary
    rc = main(["conformance", "--backend", f"{module}:{cls}", *TINY_QUICK, "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 1 and data["status"] == "fail" and message in data["error"]


def test_module_raising_at_import_exits_1_with_the_reason(capsys, broken_module):
    module = broken_module("kvcore_broken_import", raise_at_import=True)
    rc = main(["conformance", "--backend", f"{module}:RaisingConstructor", *TINY_QUICK])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"importing '{module}' raised RuntimeError: cannot find libattn.so" in err


def test_missing_module_is_a_usage_error(capsys):
    assert main(["conformance", "--backend", "kvcore_no_such_module:Thing", *TINY_QUICK]) == 2
    assert "cannot import backend class" in capsys.readouterr().err


def test_model_that_cannot_be_loaded_is_an_error_unless_left_out(capsys, tmp_path):
    missing = str(tmp_path / "no-model-here")
    rc = main(["conformance", "--backend", "sdpa", "--quick", "--model", f"tiny,{missing}", "--no-progress",
               "--tier", "cache"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot be loaded" in err and "leave it out with --model" in err
    rc = main(["conformance", "--backend", "sdpa", "--quick", "--no-progress", "--tier", "sampling", "--model",
               "tiny", "--dtype", "float32"])
    assert rc == 0  # left out: fine


# -- pytest plugin options and the repo's own conftest ------------------------------------------------------
def test_plugin_passes_constructor_options(pytester):
    result = pytester.runpytest("--kvcore-backend", "paged", "--kvcore-backend-option", "bogus=1", *PLUGIN_ARGS,
                                "-k", "test_cache", "--kvcore-dtype", "float32")
    result.assert_outcomes(errors=5)  # 3 variants, the cache driven directly, the poisoned slots
    result.stdout.fnmatch_lines(["*got unknown options: bogus*"])
    result = pytester.runpytest("--kvcore-kv-cache", "paged", "--kvcore-kv-cache-option", "block_size=8",
                                *PLUGIN_ARGS, "-k", "test_cache", "--kvcore-dtype", "float32")
    result.assert_outcomes(passed=5)


def test_bundled_suite_from_the_repo_root_sees_third_party_plugins():
    """`pytest --kvcore-backend example_chunked` from this repo's root: tests/conftest.py isolates the repo's
    own tests from third-party plugins, but not a run of the bundled suite."""
    import importlib.metadata
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not any(ep.name == "example_chunked" for ep in importlib.metadata.entry_points(group="kvcore")):
        pytest.skip("the example plugin package is not installed")
    env = {k: v for k, v in os.environ.items() if k != "KVCORE_LOAD_PLUGINS"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--kvcore-backend", "example_chunked", "--kvcore-quick", "--kvcore-model",
         "tiny", "--kvcore-dtype", "float32", "-k", "test_cache", "-q"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "5 passed" in proc.stdout  # 3 variants, the cache driven directly, the poisoned slots
