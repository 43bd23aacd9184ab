"""A quantized model's second start (kvcore/loaders/prepared.py through the model cache): its packed matmul weights and
packed LM head (int8 by default, or int4) come back as pages of the cache file, nothing is read from the loader or
packed again, and it generates the very tokens of a fresh build."""

from __future__ import annotations

import sys

import pytest
import torch

import kvcore.engine.build
import kvcore.loaders.model_cache as mc
import kvcore.model.lm_head
from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.kernels.cpu_kernels import kernel_reasons
from kvcore.kernels.huge_pages import huge_page_reason
from kvcore.kernels.quant import Int4A8Linear

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(kernel_reasons()), reason="kvcore's CPU kernels cannot run")]

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCORE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVCORE_MODEL_CACHE", "1")
    return tmp_path / "cache" / "models"


def _greedy(engine: Engine) -> list[list[int]]:
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    return [r.token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))]


def _mapped_ranges(suffix: str) -> list[tuple[int, int]]:
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].endswith(suffix):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((lo, hi))
    return ranges


def _packed(model) -> list[torch.Tensor]:
    """The packed head's codes, then every layer matmul's."""
    head = model.head_int8.packed if model.head_int8 is not None else model.head_int4.codes
    return [head, *(f.codes for fns in model._quantized.values() for f in fns)]


@pytest.mark.parametrize("lm_head", ["auto", "int4"])
def test_quantized_start_maps_its_prepared_weights(cache, monkeypatch, lm_head):
    fresh = Engine.from_pretrained("smollm2", EngineConfig(lm_head=lm_head), model_cache=False)
    chosen = "int8" if lm_head == "auto" else lm_head  # the default, on this CPU
    assert fresh.model.weight_format == "int4a8" and fresh.config.lm_head == chosen
    expected = _greedy(fresh)
    del fresh

    Engine.from_pretrained("smollm2", EngineConfig(lm_head=lm_head))  # builds the model and writes its entry
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]

    def refuse(*args, **kwargs):
        raise AssertionError("a cached start read the GGUF loader or packed a weight again")

    monkeypatch.setattr(mc, "load_model", refuse)
    monkeypatch.setattr(kvcore.model.lm_head, "int4a8_in_chunks", refuse)
    monkeypatch.setattr(kvcore.model.lm_head, "int8_linear", refuse)
    monkeypatch.setattr(Int4A8Linear, "__init__", refuse)
    engine = Engine.from_pretrained("smollm2", EngineConfig(lm_head=lm_head))
    model = engine.model
    assert model.weight_format == "int4a8" and model.fused_layers and model.fused_norm
    assert model.embedding is not None and model.embedding.blocks.in_file  # the token table read from the file
    packed = engine.lm_head.linear if chosen == "int8" else engine.lm_head.int4
    assert packed is (model.head_int8 if chosen == "int8" else model.head_int4)
    assert _greedy(engine) == expected
    if sys.platform.startswith("linux"):  # the packed weights are the cache file's pages, not a copy
        ranges = _mapped_ranges(str(entry / "model.pt"))
        assert ranges and all(any(lo <= w.data_ptr() < hi for lo, hi in ranges) for w in _packed(model))


def test_the_first_start_runs_from_the_entry_it_wrote(cache):
    """Built once to be written (plain pages), then run from the entry's mapping as later starts are: the packed
    weights are the file's pages, not the build's."""
    engine = Engine.from_pretrained("smollm2", EngineConfig())
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    weights = _packed(engine.model)
    if sys.platform.startswith("linux"):
        ranges = _mapped_ranges(str(entry / "model.pt"))
        assert ranges and all(any(lo <= w.data_ptr() < hi for lo, hi in ranges) for w in weights)


def test_a_first_start_whose_entry_cannot_be_written_runs_on_huge_pages(cache, monkeypatch):
    """The build made for an entry that then cannot be written (a full disk here) moves its packed weights into
    huge pages, as a build without the cache makes them."""
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mc, "write_entry", full)
    with pytest.warns(RuntimeWarning):
        engine = Engine.from_pretrained("smollm2", EngineConfig())
    tensors = _packed(engine.model)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one arena
    if huge_page_reason() is None:
        with open("/proc/self/smaps") as f:
            assert "hg" in _flags_of(f.read(), tensors[0].data_ptr())


def _flags_of(smaps: str, address: int) -> list[str]:
    inside = False
    for line in smaps.splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_format_without_a_saved_form_is_not_written(cache):
    """int4 weights run on torch's packed layout, which has no saved form here: built on every start, as before."""
    engine = Engine.from_pretrained("smollm2", EngineConfig(weights="int4", dtype="bfloat16"))
    assert engine.model.weight_format == "int4"
    assert not cache.exists() or not [p for p in cache.iterdir() if p.is_dir()]
    assert len(_greedy(engine)[0]) == 8


def test_entry_without_its_runtime_weights_is_rebuilt(cache, monkeypatch):
    """An entry whose description names weights its file lacks is damaged: rebuilt from the source file."""
    Engine.from_pretrained("smollm2", EngineConfig())
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    tensors = torch.load(entry / "model.pt", weights_only=True)
    del tensors["quantized.qkv.0.codes"]
    torch.save(tensors, entry / "model.pt")  # a new file: its identity no longer matches, so it is hashed again
    with pytest.warns(RuntimeWarning, match="damaged"):
        engine = Engine.from_pretrained("smollm2", EngineConfig())
    assert engine.model.weight_format == "int4a8"


@pytest.mark.full
def test_a_real_size_model_loads_and_starts_from_its_entry(cache, monkeypatch):
    """The 1.7B shape (kvcore_bench.real_size: SmolLM2-1.7B's dimensions, random Q4_1 weights), so that nothing is
    proven on 135M only: built from the file, then from its entry, the same greedy tokens."""
    import shutil

    from kvcore_bench.real_size import SHAPES, cache_dir, ensure_file

    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(folder).free < 4 << 30:
        pytest.skip(f"under 4 GiB free in {folder} for the 1.7B file and its cache entry")
    path = str(ensure_file("1.7b"))
    shape = SHAPES["1.7b"]
    built = Engine.from_pretrained(path, EngineConfig(), model_cache=False)
    c = built.model.config
    assert (c.hidden_size, c.num_hidden_layers, c.intermediate_size) == (shape.hidden, shape.layers, shape.ffn)
    prompt = [built.tokenizer.encode("Hello")]
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    expected = built.generate(prompt, params)[0].token_ids
    del built
    Engine.from_pretrained(path, EngineConfig())  # writes the entry
    monkeypatch.setattr(mc, "load_model", lambda *a, **k: pytest.fail("the loader ran for a cached model"))
    assert Engine.from_pretrained(path, EngineConfig()).generate(prompt, params)[0].token_ids == expected
