"""kvcore_bench.real_size: real-shape GGUFs with random weights, written through the same code at a tiny shape;
kvcore loads them, runs a greedy step, and the startup table is printed from them."""

from __future__ import annotations

import argparse
import json
import re
import shutil

import gguf
import pytest

from kvcore import Engine, SamplingParams
from kvcore.loaders import load_model
from kvcore.loaders.gguf_metadata import read_gguf, tensor_data
from kvcore.loaders.resolve import smollm2_path
from kvcore.paths import cache_root
from kvcore_bench import real_size, sizes
from kvcore_bench.real_size import WEIGHT_STD, Shape, ensure_file, write_gguf

VOCAB_ROWS = 49152
TINY = Shape(hidden=64, layers=2, ffn=128, heads=4, kv_heads=2, head_dim=16)


@pytest.fixture
def tiny_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCORE_BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(real_size.SHAPES, "tiny", TINY)
    return tmp_path / "cache"


def test_tiny_file_loads_and_generates(tiny_cache):
    path = ensure_file("tiny")
    assert path == tiny_cache / "llama-tiny-q4_1.gguf"
    assert [p.name for p in tiny_cache.iterdir()] == [path.name]  # no temporary file left behind
    written = path.stat().st_mtime_ns
    assert ensure_file("tiny") == path and path.stat().st_mtime_ns == written  # reused, not rewritten

    loaded = load_model(str(path), keep_quantized=True)
    c = loaded.config
    assert (c.hidden_size, c.num_hidden_layers, c.intermediate_size) == (64, 2, 128)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (4, 2, 16, 49152)
    assert c.tie_word_embeddings and c.rope_theta == TINY.rope_theta
    types = {name: getattr(w, "qtype", None) for name, w in loaded.weights.items()}
    assert types.pop("model.embed_tokens.weight") == gguf.GGMLQuantizationType.Q8_0
    matrices = {name: t for name, t in types.items() if t is not None}
    assert len(matrices) == 7 * 2 and set(matrices.values()) == {gguf.GGMLQuantizationType.Q4_1}

    engine = Engine.from_pretrained(str(path))
    out = engine.generate(["Hello"], SamplingParams(max_new_tokens=2, ignore_eos=True))[0]
    assert len(out.token_ids) == 2 and all(0 <= t < 49152 for t in out.token_ids)


#: rows of whole 256-value K-quant blocks
TINY_K = Shape(hidden=256, layers=2, ffn=512, heads=4, kv_heads=2, head_dim=64)


@pytest.mark.parametrize("qtype, shape", [("q4_0", TINY), ("q8_0", TINY), ("q4_k", TINY_K)])
def test_other_types_are_reproducible_and_centred(tmp_path, qtype, shape):
    a = write_gguf(tmp_path / "a.gguf", shape, qtype)
    b = write_gguf(tmp_path / "b.gguf", shape, qtype)
    assert a.read_bytes() == b.read_bytes()  # a fixed seed: the same file every time

    layout, metadata = read_gguf(a)  # kvcore's reader: gguf's takes seconds on the vocabulary
    tensors = {t.name: t for t in layout.tensors}
    want = gguf.GGMLQuantizationType[qtype.upper()]
    assert tensors["token_embd.weight"].ggml_type == gguf.GGMLQuantizationType.Q8_0
    assert tensors["blk.1.ffn_down.weight"].ggml_type == want
    assert tensors["output_norm.weight"].ggml_type == gguf.GGMLQuantizationType.F32
    values = gguf.quants.dequantize(tensor_data(a, tensors["blk.0.ffn_up.weight"]), want)
    assert values.shape == (shape.ffn, shape.hidden)
    assert abs(values.std() / WEIGHT_STD - 1) < 0.1 and abs(values.mean()) < 0.003
    source = read_gguf(smollm2_path())[1]
    assert {k: v for k, v in metadata.items() if k.startswith("tokenizer.")} == {
        k: v for k, v in source.items() if k.startswith("tokenizer.")}
    assert "tokenizer.chat_template" in metadata


def test_real_size_tier_measures_a_file_and_writes_its_table(tiny_cache, tmp_path, monkeypatch):
    """kvcore bench --real-size on the tiny shape, kvcore alone: every figure measured, one table row, the plot."""
    cache = tmp_path / "kvcore"
    if (cache_root() / "kernels").is_dir():  # the built kernels, not a rebuild in every subprocess
        shutil.copytree(cache_root() / "kernels", cache / "kernels")
    monkeypatch.setenv("KVCORE_CACHE_DIR", str(cache))
    monkeypatch.setenv("KVCORE_MODEL_CACHE", "1")  # the suite turns it off; the tier measures it
    args = argparse.Namespace(real_size="tiny", threads=2, reps=1, quick=False, no_llamacpp=True, progress=False,
                              out=str(tmp_path / "out"))
    assert sizes.run_real_size(args) == 0

    report = json.loads((tmp_path / "out" / "real-size.json").read_text())
    (row,) = report["rows"]
    path = tiny_cache / "llama-tiny-q4_1.gguf"
    assert (row["shape"], row["qtype"], row["file"]) == ("tiny", "q4_1", str(path))
    # the starts' entry, and the speed run's (its own max_model_len)
    entries = sizes.prepared_entries(path)
    assert {e.parent for e in entries} == {cache / "models"} and len(entries) == 2
    assert len(row["first_start_s"]) == 2 and all(len(v) == 1 for v in row["start_s"].values())
    assert all(s > 0 for s in [row["read_from_disk_s"], *row["first_start_s"], *sum(row["start_s"].values(), [])])
    assert 0 < row["pss_bare_adds_mib"] and 0 < row["pss_second_adds_mib"] and row["rss_above_import_mib"][0] > 0
    speeds = row["median"]
    assert not any(k.startswith("llama.cpp") for k in speeds)
    assert all(speeds[k] > 0 for k in ("b1 mapped", "b1 built", "prefill", "batch", "read GB/s"))
    # the LM head's packed bytes alone are 49,152 rows x 64 columns at over a byte each
    assert speeds["step bytes"] > VOCAB_ROWS * TINY.hidden

    table = (tmp_path / "out" / "real-size.md").read_text().splitlines()
    assert table[2].startswith("| file |") and [line[:14] for line in table[4:]] == ["| tiny q4_1 | "]
    assert "kvcore bench --real-size tiny --reps 1 --no-llamacpp" in table[0]
    assert (tmp_path / "out" / "real-size.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("spec, message", [("", "at least one"), ("2b", "is not SHAPE[:TYPE]"),
                                           ("1.7b:q5_0", "is not SHAPE[:TYPE]"), ("360m:q4_k", "blocks of 256")])
def test_real_size_files_are_checked_before_anything_runs(spec, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        sizes.parse_files(spec)
    assert sizes.parse_files("360m, 1.7b:q4_k") == [("360m", "q4_1"), ("1.7b", "q4_k")]
