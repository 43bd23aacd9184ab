"""Every supported family against transformers: a tiny random checkpoint built in the test, saved as
safetensors and written to GGUF the way llama.cpp's converter lays it out, gives transformers' greedy ids
(float32, EOS suppressed) through the naive, sdpa and paged backends (and cpu_decode for the families
whose sliding windows and soft-caps act on the prompts), from both formats."""

from __future__ import annotations

import pytest
from tiny_checkpoints import (
    COMMON,
    FAMILIES,
    GGUF_WITHOUT_WINDOW,
    WINDOWED,
    build_hf,
    greedy_reference,
    save_hf,
    write_gguf,
)

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.backends.cpu_decode import CPUDecodeBackend
from kvcore.loaders import build_model, load_model

pytest.importorskip("transformers")

PROMPTS = [[5, 71, 200, 9, 33, 140, 87], [250, 3, 64], [12, 180, 99, 301, 45, 7, 66, 120, 2, 31, 222]]
NEW_TOKENS = 10
BACKENDS = ("naive", "sdpa", "paged")
#: longrope picks its factors by the longest sequence served: transformers' short factors below 64
#: (llama.cpp's converter writes Mistral as the "llama" GGUF arch)
MAX_MODEL_LEN = {"phi3-longrope": 64}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (HF directory, GGUF file, transformers' greedy ids)."""
    out = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(family)
        model = build_hf(family)
        out[family] = (
            save_hf(model, root / "hf"),
            write_gguf(model, family, root / "model.gguf"),
            greedy_reference(model, PROMPTS, NEW_TOKENS),
        )
    return out


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(checkpoints, family, fmt):
    if fmt == "gguf" and family in GGUF_WITHOUT_WINDOW:
        pytest.skip("llama.cpp's converter writes no sliding window for this arch")
    hf_dir, gguf_file, want = checkpoints[family]
    loaded = load_model(str(hf_dir if fmt == "hf" else gguf_file))
    arch = family.split("-")[0].removesuffix("3.1")
    assert loaded.config.architecture == ("llama" if (arch, fmt) == ("mistral", "gguf") else arch)
    model = build_model(loaded, max_model_len=MAX_MODEL_LEN.get(family))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    configs = [(backend, {}) for backend in BACKENDS]
    if family in WINDOWED and CPUDecodeBackend.availability() is None:  # its variant layers run sdpa's paths
        configs.append(("cpu_decode", {}))
    if family in WINDOWED:  # the variants as FlexAttention's mods on both caches (eager; compiled is the full tier's)
        eager = {"backend_options": {"flex": {"compile": False}}}
        configs += [("flex", eager), ("flex", {"kv_cache": "paged", **eager})]
    for backend, extra in configs:
        engine = Engine(model, loaded.tokenizer, EngineConfig(backend=backend, max_num_seqs=4, **extra))
        got = [r.token_ids for r in engine.generate(PROMPTS, params)]
        assert got == want, f"{family} ({fmt}) through {backend} {extra or ''} diverges from transformers"


def test_rope_tables_sized_to_max_model_len(checkpoints):
    loaded = load_model(str(checkpoints["llama"][0]))
    model = build_model(loaded, max_model_len=48)
    assert model.rotary.cos.shape == (48, 8) and model.config.max_position_embeddings == 48
    engine = Engine(model, None, EngineConfig(backend="sdpa"))
    assert engine.max_model_len == 48
    assert build_model(loaded).rotary.cos.shape[0] == 128  # default: the window (capped at 4096)


def test_windows_shorter_than_the_context_are_declared_per_layer(tmp_path):
    import transformers

    config = transformers.MistralConfig(**{**_small(), "sliding_window": 16})
    loaded = load_model(str(save_hf(transformers.MistralForCausalLM(config), tmp_path / "mistral")))
    assert loaded.config.sliding_window == 16
    assert [a.sliding_window for a in build_model(loaded).attention_layers] == [16, 16]
    # a window as long as every sequence this instance serves hides nothing: plain causal layers
    assert [a.variants for a in build_model(loaded, max_model_len=16).attention_layers] == [frozenset()] * 2


def test_gemma2_attention_softcapping_is_declared(tmp_path):
    import transformers

    config = transformers.Gemma2Config(**{**_small(), "attn_logit_softcapping": 50.0, "sliding_window": 8})
    loaded = load_model(str(save_hf(transformers.Gemma2ForCausalLM(config), tmp_path / "g")))
    layers = build_model(loaded).attention_layers
    assert [(a.sliding_window, a.softcap, a.scale) for a in layers] == [(8, 50.0, 256**-0.5), (None, 50.0, 256**-0.5)]


def _small() -> dict:
    return dict(COMMON)
