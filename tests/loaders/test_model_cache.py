"""The on-disk cache of prepared models (kvcore/loaders/model_cache.py): a cached start gives the very model, layout
and tokenizer a fresh load builds, skips the loader, and notices changed files, damaged entries and options."""

from __future__ import annotations

import os

import pytest
import torch
from tiny_checkpoints import build_hf, write_gguf

import kvcore.loaders.model_cache
from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.loaders.model_cache import MAX_ENTRIES, cache_dir, clear, load_pretrained

pytest.importorskip("transformers")

#: tied embeddings (qwen2), RoPE factors from a tensor (llama3.1), sandwich norms + soft-capping (gemma2)
FAMILIES = ("llama", "qwen2", "llama3.1", "gemma2")
PROMPTS = [[5, 71, 200, 9, 33], [250, 3, 64, 17]]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCORE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVCORE_MODEL_CACHE", "1")
    return tmp_path / "cache" / "models"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {f: write_gguf(build_hf(f), f, root / f"{f}.gguf") for f in FAMILIES}


def _entries(cache):
    return sorted(p for p in cache.iterdir() if p.is_dir()) if cache.is_dir() else []


def _no_loader(monkeypatch):
    def refuse(spec):
        raise AssertionError("the loader ran although the model was cached")

    monkeypatch.setattr(kvcore.loaders.model_cache, "load_model", refuse)  # where the cache calls it


def _greedy(model, tokenizer):
    engine = Engine(model, tokenizer, EngineConfig(backend="sdpa", max_num_seqs=2))
    return [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True))]


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_model_is_the_built_model(ggufs, cache, monkeypatch, family):
    fresh, fresh_tok = load_pretrained(str(ggufs[family]), use_cache=False)
    assert not _entries(cache)
    first, _ = load_pretrained(str(ggufs[family]))  # builds and writes the entry
    assert len(_entries(cache)) == 1
    _no_loader(monkeypatch)
    cached, tok = load_pretrained(str(ggufs[family]))
    assert cached.config == fresh.config
    want = dict(fresh.named_parameters(remove_duplicate=False)) | dict(fresh.named_buffers())
    got = dict(cached.named_parameters(remove_duplicate=False)) | dict(cached.named_buffers())
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor) and got[name].stride() == tensor.stride(), name
        assert got[name].dtype == tensor.dtype and not got[name].requires_grad
    if fresh.config.tie_word_embeddings:
        assert cached.lm_head is cached.embed_tokens
    text = "The quick brown fox. 12 + 30 = 42"
    assert tok.encode(text) == fresh_tok.encode(text)
    assert (tok.eos_token_ids, tok.bos_token_id, tok.add_bos) == (
        fresh_tok.eos_token_ids, fresh_tok.bos_token_id, fresh_tok.add_bos)
    assert _greedy(cached, tok) == _greedy(fresh, fresh_tok) == _greedy(first, fresh_tok)


def test_cached_model_keeps_the_files_window(ggufs, cache, monkeypatch):
    """RoPE tables built shorter than the window (max_model_len): a cached load still knows the file's window,
    which a context-limit error names."""
    path = str(ggufs[FAMILIES[0]])
    fresh, _ = load_pretrained(path, max_model_len=16)
    assert fresh.config.max_position_embeddings == 16 < fresh.context_window
    _no_loader(monkeypatch)
    cached, _ = load_pretrained(path, max_model_len=16)
    assert (cached.config, cached.context_window) == (fresh.config, fresh.context_window)


def test_options_and_file_versions_get_their_own_entries(ggufs, cache, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(ggufs["llama"].read_bytes())
    load_pretrained(str(path))
    model, _ = load_pretrained(str(path), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    load_pretrained(str(path), max_model_len=64)
    assert len(_entries(cache)) == 3
    os.utime(path, ns=(1, 1))  # a new version of the file: its old entries go
    model, _ = load_pretrained(str(path), max_model_len=64)
    assert len(_entries(cache)) == 1 and model.rotary.cos.shape[0] == 64


def test_at_most_max_entries(ggufs, cache):
    for length in range(32, 32 + MAX_ENTRIES + 2):
        load_pretrained(str(ggufs["llama"]), max_model_len=length)
    assert len(_entries(cache)) == MAX_ENTRIES
    assert clear() == MAX_ENTRIES and not _entries(cache)


def test_damaged_entry_is_rebuilt(ggufs, cache):
    load_pretrained(str(ggufs["llama"]))
    (entry,) = _entries(cache)
    (entry / "model.pt").write_bytes(b"not a torch file")
    with pytest.warns(RuntimeWarning, match="is damaged; rebuilding it"):
        model, _ = load_pretrained(str(ggufs["llama"]))  # falls back to the loader, then rewrites the entry
    assert model.embed_tokens.shape[0] == 320
    load_pretrained(str(ggufs["llama"]))
    assert (entry / "model.pt").stat().st_size > 1000


def test_off_by_environment_and_option(ggufs, cache, monkeypatch):
    monkeypatch.setenv("KVCORE_MODEL_CACHE", "0")
    load_pretrained(str(ggufs["llama"]))
    assert not _entries(cache)
    monkeypatch.setenv("KVCORE_MODEL_CACHE", "1")
    Engine.from_pretrained(str(ggufs["llama"]), EngineConfig(backend="sdpa"), model_cache=False)
    assert not _entries(cache)
    Engine.from_pretrained(str(ggufs["llama"]), EngineConfig(backend="sdpa"))
    assert len(_entries(cache)) == 1 and cache == cache_dir()


def test_unwritable_cache_only_costs_the_cache(ggufs, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("KVCORE_CACHE_DIR", str(blocker))  # a file: no folder can be made under it
    monkeypatch.setenv("KVCORE_MODEL_CACHE", "1")
    with pytest.warns(RuntimeWarning, match="cannot use the model cache .* running without it"):
        model, tok = load_pretrained(str(ggufs["llama"]))
    assert tok.encode("fox") and model.config.num_hidden_layers == 2
