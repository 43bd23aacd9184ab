"""kvcore_bench.real_size: real-shape GGUFs with random weights, written through the same code at a tiny shape;
kvcore loads them, runs a greedy step, and the startup table is printed from them."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from kvcore import Engine, SamplingParams
from kvcore.loaders import load_model
from kvcore.loaders.gguf_metadata import read_gguf, tensor_data
from kvcore.loaders.resolve import smollm2_path
from kvcore_bench import real_size
from kvcore_bench.real_size import WEIGHT_STD, Shape, ensure_file, write_gguf

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


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_other_types_are_reproducible_and_centred(tmp_path, qtype):
    a = write_gguf(tmp_path / "a.gguf", TINY, qtype)
    b = write_gguf(tmp_path / "b.gguf", TINY, qtype)
    assert a.read_bytes() == b.read_bytes()  # a fixed seed: the same file every time

    layout, metadata = read_gguf(a)  # kvcore's reader: gguf's takes seconds on the vocabulary
    tensors = {t.name: t for t in layout.tensors}
    want = gguf.GGMLQuantizationType[qtype.upper()]
    assert tensors["token_embd.weight"].ggml_type == gguf.GGMLQuantizationType.Q8_0
    assert tensors["blk.1.ffn_down.weight"].ggml_type == want
    assert tensors["output_norm.weight"].ggml_type == gguf.GGMLQuantizationType.F32
    values = gguf.quants.dequantize(tensor_data(a, tensors["blk.0.ffn_up.weight"]), want)
    assert values.shape == (128, 64) and abs(values.std() / WEIGHT_STD - 1) < 0.1 and abs(values.mean()) < 0.003
    source = read_gguf(smollm2_path())[1]
    assert {k: v for k, v in metadata.items() if k.startswith("tokenizer.")} == {
        k: v for k, v in source.items() if k.startswith("tokenizer.")}
    assert "tokenizer.chat_template" in metadata


def test_startup_prints_a_row_per_shape(tiny_cache, tmp_path, capsys):
    out = tmp_path / "startup.json"
    assert real_size.main(["startup", "tiny", "--reps", "1", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| shape |") and lines[2].startswith("| tiny q4_1 |") and len(lines) == 3
    (row,) = json.loads(out.read_text())
    assert row["shape"] == "tiny" and len(row["reps_s"]) == len(row["cpu_s"]) == 1 and row["median_s"] > 0
    assert np.isclose(row["file_mib"], (tiny_cache / "llama-tiny-q4_1.gguf").stat().st_size / 2**20, atol=0.1)
