"""``kvcore bench --llamacpp-native``: finding built llama.cpp tools, reading their JSON, the report; with stand-in
tools (the real build takes minutes and runs by hand, benchmarks/README.md)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from kvcore.errors import ConfigError
from kvcore_bench import native_llamacpp
from kvcore_bench.native_llamacpp import TOOLS, batched_bench, build_tools, llama_bench
from kvcore_bench.vs_native import render_native


def fake_tool(path: Path, stdout: str, rc: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho \"$@\" > {path}.args\ncat <<'EOF'\n{stdout}\nEOF\nexit {rc}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_built_tools_are_found_and_not_rebuilt(tmp_path, monkeypatch):
    bin_dir = tmp_path / "0.3.36" / "bin"
    for tool in TOOLS:
        fake_tool(bin_dir / tool, "")
    monkeypatch.setattr(native_llamacpp.subprocess, "run", lambda *a, **k: pytest.fail("must not build"))
    assert build_tools(tmp_path) == bin_dir


def test_a_failed_build_step_is_one_config_error(tmp_path, monkeypatch):
    class Done:
        returncode, stdout, stderr = 1, "", "ERROR: No matching distribution found for llama-cpp-python"

    monkeypatch.setattr(native_llamacpp.subprocess, "run", lambda *a, **k: Done())
    with pytest.raises(ConfigError, match="building llama.cpp failed at 'pip download .*No matching distribution"):
        build_tools(tmp_path, progress=False)


def test_the_tools_json_is_read(tmp_path):
    row = {"avg_ts": 123.4, "cpu_info": "Intel Xeon", "backends": "CPU", "build_commit": "abc", "n_gen": 128}
    fake_tool(tmp_path / "llama-bench", json.dumps([row], indent=2))
    assert llama_bench(tmp_path, Path("m.gguf"), 2)["avg_ts"] == 123.4
    args = (tmp_path / "llama-bench.args").read_text().split()
    assert args[args.index("-n") + 1] == "128" and args[args.index("-p") + 1] == "0" and "json" in args
    lines = "llama_model_load: noise\n" + "\n".join(json.dumps({"pl": p, "speed_tg": 10.0 * p}) for p in (1, 8))
    fake_tool(tmp_path / "llama-batched-bench", lines)
    rows = batched_bench(tmp_path, Path("m.gguf"), 2, [1, 8], 64, 128, ctx=2048)
    assert [r["speed_tg"] for r in rows] == [10.0, 80.0]
    assert "--no-repack -npl 1,8" in (tmp_path / "llama-batched-bench.args").read_text()
    fake_tool(tmp_path / "llama-bench", "", rc=1)
    with pytest.raises(ConfigError, match=r"llama-bench failed \(exit code 1\)"):
        llama_bench(tmp_path, Path("m.gguf"), 2)


def test_report_shows_ratios_load_and_memory_per_repetition():
    run = {"rep": 0, "load_average": 3.5,
           "kvcore": {"cli_b1": 150.0, "api_b1": 200.0, "batch8": 600.0, "cli_rss_above_import_mib": 188.0},
           "llama.cpp": {"tg128": 100.0, "batch8": 200.0},
           "ratios": {"cli_b1": 1.5, "api_b1": 2.0, "batch8": 3.0}}
    report = {"environment": {"command": "kvcore bench --llamacpp-native", "cpu": "Xeon", "isa": {"avx512_vnni": True},
                              "torch_cpu_capability": "AVX512", "threads": 2, "load_average_end": 4.0},
              "gguf": "/x/model.gguf", "gguf_bytes": 94 * 2**20, "kvcore_default": {"dtype": "bfloat16", "reasons": []},
              "kvcore_kernels": "int4a8", "llama_cpp": {"build_commit": "abc", "backends": "CPU", "cpu_info": "Xeon"},
              "reps": 1, "seconds": 10.0, "runs": [run], "median": run["ratios"], "median_rss_above_import_mib": 188.0}
    text = render_native(report)
    assert "| 1 | 3.5 | 150.0 | 200.0 | 600.0 | 100.0 | 200.0 | 1.50x | 2.00x | 3.00x | 188 MiB (2.0x file) |" in text
    assert "ISA: avx512_vnni" in text and '{"dtype": "bfloat16"}' in text
