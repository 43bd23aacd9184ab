"""Every supported family against transformers: a tiny random checkpoint built in the test, saved as
safetensors and written to GGUF the way llama.cpp's converter lays it out, gives transformers' greedy ids
(float32, EOS suppressed) through the naive, sdpa and paged backends, from both formats."""

from __future__ import annotations

import pytest
from tiny_checkpoints import COMMON, FAMILIES, build_hf, greedy_reference, save_hf, write_gguf

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.errors import ModelLoadError
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
    hf_dir, gguf_file, want = checkpoints[family]
    loaded = load_model(str(hf_dir if fmt == "hf" else gguf_file))
    arch = family.split("-")[0].removesuffix("3.1")
    assert loaded.config.architecture == ("llama" if (family, fmt) == ("mistral", "gguf") else arch)
    model = build_model(loaded, max_model_len=MAX_MODEL_LEN.get(family))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for backend in BACKENDS:
        engine = Engine(model, loaded.tokenizer, EngineConfig(backend=backend, max_num_seqs=4))
        got = [r.token_ids for r in engine.generate(PROMPTS, params)]
        assert got == want, f"{family} ({fmt}) through {backend} diverges from transformers"


def test_rope_tables_sized_to_max_model_len(checkpoints):
    loaded = load_model(str(checkpoints["llama"][0]))
    model = build_model(loaded, max_model_len=48)
    assert model.rotary.cos.shape == (48, 8) and model.config.max_position_embeddings == 48
    engine = Engine(model, None, EngineConfig(backend="sdpa"))
    assert engine.max_model_len == 48
    assert build_model(loaded).rotary.cos.shape[0] == 128  # default: the window (capped at 4096)


def test_sliding_window_shorter_than_max_model_len_is_refused(tmp_path):
    import transformers

    config = transformers.MistralConfig(**{**_small(), "sliding_window": 16})
    save_hf_dir = save_hf(transformers.MistralForCausalLM(config), tmp_path / "mistral")
    loaded = load_model(str(save_hf_dir))
    assert loaded.config.sliding_window == 16
    refused = r"sliding-window attention \(window 16 tokens\) is not supported.*at most 16"
    with pytest.raises(ModelLoadError, match=refused):
        build_model(loaded)
    assert build_model(loaded, max_model_len=16).config.max_position_embeddings == 16  # then it is plain attention


def test_gemma2_attention_softcapping_is_refused(tmp_path):
    import transformers

    config = transformers.Gemma2Config(**{**_small(), "attn_logit_softcapping": 50.0, "sliding_window": 4096})
    loaded = load_model(str(save_hf(transformers.Gemma2ForCausalLM(config), tmp_path / "g")))
    with pytest.raises(ModelLoadError, match=r"gemma2: attention-logit soft-capping \(attn_logit_softcapping=50.0\)"):
        build_model(loaded)


def _small() -> dict:
    return dict(COMMON)
