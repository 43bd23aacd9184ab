"""``kvcore bench --scale``: the quick mode's kvcore side on the tiny model, llama-batched-bench's rows as captured
from a real run (read through a stand-in tool: the native run takes minutes, benchmarks/README.md), the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bench_native import fake_tool

from kvcore import Engine
from kvcore_bench.native_llamacpp import batched_bench
from kvcore_bench.scale import QUICK, KvcoreSide, llamacpp_point, run_points
from kvcore_bench.scale_report import render_scale, write_scale

#: llama-batched-bench 0.3.36 --output-format jsonl on SmolLM2 Q4_1, two threads, a busy machine (stdout; the log goes
#: to stderr): 128-token prompts at 8 sequences, and one 256-token prompt shared by 4 sequences (-pps -kvu)
CAPTURED = (
    '{"n_kv_max": 4096, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, '
    '"n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 16, "pl": 8, "n_kv": 1152, "t_pp": 33.705063, '
    '"speed_pp": 30.381193, "t_tg": 19.803972, "speed_tg": 6.463350, "t": 53.509033, "speed": 21.529076}\n'
    '{"n_kv_max": 512, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 1, "n_gpu_layers": -1, '
    '"n_threads": 2, "n_threads_batch": 2, "pp": 256, "tg": 8, "pl": 4, "n_kv": 288, "t_pp": 12.836704, '
    '"speed_pp": 19.942814, "t_tg": 47.643997, "speed_tg": 0.671648, "t": 60.480701, "speed": 4.761849}'
)


def test_quick_mode_runs_every_point_on_both_kvcore_configurations(random_model):
    calls = []

    def llamacpp(kind, seqs, new):  # a stand-in peer: 10 tok/s per sequence
        calls.append((kind, seqs, new))
        return {"tok_s": 10.0 * seqs, "ttft_s": 1.0}

    kv = KvcoreSide(lambda config: Engine(random_model, None, config), QUICK, {})
    points = run_points(kv, llamacpp, QUICK, reps=1)
    long_prompt = QUICK.long_context - QUICK.long_new_tokens  # 504 tokens: the tiny model's whole window
    assert calls == [("short", 1, 16), ("short", 8, 16), ("long", 1, 8), ("long", 8, 8)]
    assert [(p["kind"], p["seqs"], p["prompt_tokens"]) for p in points] == [
        ("short", 1, 32), ("short", 8, 32), ("long", 1, long_prompt), ("long", 8, long_prompt)]
    for p in points:
        (run,) = p["runs"]
        # the defaults (sdpa, contiguous, no prefix cache) would prefill the long prompt 8 times: one request there
        expected = {"kvcore paged", "llama.cpp"} if p["kind"] == "long" and p["seqs"] == 8 else \
            {"kvcore paged", "kvcore default", "llama.cpp"}
        assert {s for s, v in run.items() if isinstance(v, dict)} == expected
        for side in expected - {"llama.cpp"}:
            assert run[side]["tok_s"] > 0 and run[side]["ttft_s"] > 0
            assert p["median"][side]["ratio"] == run[side]["tok_s"] / (10.0 * p["seqs"])
    # one prefill of the shared prompt: the 7 other requests reuse its full blocks, all but the last token
    shared = points[3]["runs"][0]["kvcore paged"]
    assert shared["cached_prompt_tokens"] == 7 * ((long_prompt - 1) // 16 * 16)
    assert points[2]["runs"][0]["kvcore paged"]["cached_prompt_tokens"] == 0  # a new prompt each time: cold
    assert kv.describe()["paged"]["prefix_caching"] and not kv.describe()["default"]["prefix_caching"]


def test_batched_bench_rows_as_captured_are_read(tmp_path):
    fake_tool(tmp_path / "llama-batched-bench", "llama_model_load: noise on stdout\n" + CAPTURED)
    short, shared = batched_bench(tmp_path, Path("m.gguf"), 2, [4], 256, 8, ctx=512, shared_prompt=True)
    assert llamacpp_point(short) == {"tok_s": 6.46335, "ttft_s": 33.705063}  # S_TG, not S (prompt + generation)
    assert llamacpp_point(shared) == {"tok_s": 0.671648, "ttft_s": 12.836704}
    args = (tmp_path / "llama-batched-bench.args").read_text()
    assert "-npp 256 -ntg 8 --no-repack -pps -kvu -npl 4" in args and "-c 512" in args
    batched_bench(tmp_path, Path("m.gguf"), 2, [8], 128, 16, ctx=2112)
    assert "-pps" not in (tmp_path / "llama-batched-bench.args").read_text()


def test_report_tables_and_plot(tmp_path):
    def run(rep, kv, lc):
        return {"rep": rep, "load_average": "1.0 1.0 1.0", "kvcore paged": {"tok_s": kv, "ttft_s": 0.5},
                "llama.cpp": {"tok_s": lc, "ttft_s": 2.0}}

    report = {
        "environment": {"command": "kvcore bench --scale", "cpu": "Xeon", "isa": {"avx512f": True, "amx_bf16": False},
                        "torch_cpu_capability": "AVX512", "threads": 2, "load_average_end": "1.0"},
        "gguf": "/x/m.gguf", "plan": {"prompt_tokens": 128}, "reps": 2, "seconds": 5.0,
        "kvcore": {"paged": {"kernels": "paged attention", "prefix_caching": True}},
        "llama_cpp": {"flags": "-pps -kvu", "build_commit": "abc", "backends": "CPU", "cpu_info": "Xeon"},
        "points": [
            {"kind": "short", "seqs": 8, "prompt_tokens": 128, "new_tokens": 128,
             "runs": [run(0, 300.0, 100.0), run(1, 330.0, 110.0)]},
            {"kind": "long", "seqs": 8, "prompt_tokens": 8128, "new_tokens": 32, "runs": [run(0, 90.0, 60.0)]},
        ],
    }
    text = render_scale(report)
    assert "| 8 | 128 | 128 | 2 | 1.0 1.0 1.0 | 330.0 | 110.0 | 3.00x | 0.50 s | 2.00 s |" in text
    assert "| 8 | 8128 | 32 | 1 | 1.0 1.0 1.0 | 90.0 | 60.0 | 1.50x |" in text
    assert "ISA: avx512f;" in text and "prefix caching on" in text
    paths = write_scale(report, tmp_path)
    assert json.loads((tmp_path / "scale-curves.json").read_text())["points"][1]["seqs"] == 8
    assert tmp_path / "scale-curves.png" in paths and (tmp_path / "scale-curves.png").stat().st_size > 1000


def _break_even_module():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "studies" / "compile_break_even.py"
    spec = importlib.util.spec_from_file_location("compile_break_even", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compile_break_even_is_where_the_lines_cross():
    m = _break_even_module()
    eager = m.fit([(100, 11.0), (1100, 21.0)])  # 10 s + 10 ms/token
    assert eager == pytest.approx((10.0, 0.01))
    assert m.break_even(eager, (30.0, 0.005)) == pytest.approx(4000)  # 20 s more, 5 ms/token less
    assert m.break_even(eager, (30.0, 0.01)) is None  # never cheaper per token: never pays
    assert m.break_even(eager, (5.0, 0.005)) == 0.0  # cheaper from the first token
