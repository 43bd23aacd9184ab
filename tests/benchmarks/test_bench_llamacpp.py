"""``kvcore bench --llamacpp``'s orchestration and report, without llama.cpp (the real comparison needs
llama-cpp-python, an optional extra of kvcore-bench, and runs only by hand)."""

from __future__ import annotations

import argparse

import pytest

from kvcore.errors import ConfigError
from kvcore_bench import vs_llamacpp
from kvcore_bench.common import cpu_features, engine_options
from kvcore_bench.vs_llamacpp import WORKLOADS, alternate, render


def fake_side(name, order, tok_s, ttft):
    def run(prompts, n):
        order.append(name)
        return ttft, tok_s, [[7] * n for _ in prompts]
    return run


def test_alternate_alternates_sides_and_takes_medians():
    order = []
    jobs = {"decode": ([[1, 2]], 3), "long": ([[1] * 5], 2), "batch8": ([[1], [2], [3]], 4)}
    rows, agree = alternate(jobs, fake_side("kv", order, 20.0, 0.5), fake_side("lc", order, 40.0, 1.0), reps=2)
    assert order[:2] == ["kv", "lc"] and order[6:8] == ["lc", "kv"]  # rep 2 starts with llama.cpp
    assert [r["workload"] for r in rows] == list(WORKLOADS)
    by = {r["workload"]: r for r in rows}
    assert by["decode"]["ratio"] == pytest.approx(0.5) and by["batch8"]["kvcore_runs"] == [20.0, 20.0]
    assert by["ttft_2k"]["ratio"] == pytest.approx(2.0)  # llama.cpp / kvcore: above 1 = kvcore ahead
    assert agree == {"decode": 1.0, "long": 1.0, "batch8": 1.0}


def test_engine_options_are_json_or_strings():
    assert engine_options(["max_num_seqs=4", "weights=int4", "enable_prefix_caching=true"]) == {
        "max_num_seqs": 4, "weights": "int4", "enable_prefix_caching": True}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        engine_options(["oops"])


def test_report_states_the_machine_and_kernels():
    env = {"command": "kvcore bench --llamacpp", "torch": "2", "threads": 2, "load_average": "1", **cpu_features(),
           "llama_cpp_python": "0.3", "llama_cpp_system_info": "AVX2 = 1", "load_average_end": "1"}
    rows = [{"workload": "decode", "unit": "tok/s", "kvcore": 20.0, "llama.cpp": 40.0, "ratio": 0.5},
            {"workload": "ttft_2k", "unit": "s", "kvcore": 2.0, "llama.cpp": 1.0, "ratio": 0.5}]
    report = {"environment": env, "gguf": "/x/model.gguf", "kvcore_config": {"dtype": "float32"},
              "kvcore_kernels": "attention sdpa", "llama_cpp_batching": "batched", "reps": 1, "new_tokens": 8,
              "long_new_tokens": 4, "seconds": 1.0, "greedy_token_agreement": {"decode": 0.5}, "results": rows}
    text = render(report)
    assert "torch CPU capability" in text and "threads: 2" in text and "attention sdpa" in text
    assert "| decode, batch 1, 64-token prompt | 20.0 tok/s | 40.0 tok/s | 0.50x |" in text
    assert "| TTFT, 2048-token prompt | 2.00 s | 1.00 s | 0.50x |" in text


def test_missing_llama_cpp_is_a_one_line_config_error(monkeypatch):
    monkeypatch.setattr("kvcore_bench.llamacpp_runner.llama_cpp_version", lambda: None)
    args = argparse.Namespace(threads=0, model="smollm2", reps=1, quick=True, engine_option=None, backend=None,
                              dtype="float32", out="unused", progress=False)
    with pytest.raises(ConfigError, match="llama-cpp-python is not installed"):
        vs_llamacpp.run_llamacpp(args)
