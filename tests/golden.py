"""The golden oracle shared by the test packages: fp32 greedy tokens against transformers' goldens
(``scripts/make_golden.py``; tests/data/README.md), importable from any test module (``from golden import ...``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcore import Engine, EngineConfig, LlamaModel, SamplingParams

DATA = Path(__file__).parent / "data"
#: the SmolLM2 goldens' bounded form in ``make test``: the first tokens of every prompt, so a wrong token there
#: still fails (decode steps are the cost, not prompts; a multiple of 16 positions crosses a KV block of 16 in
#: every stream); the full tier (``--full``) checks all of them
FIRST_TOKENS = 16
#: a SmolLM2 golden test's token counts: the bounded form, and every token in the full tier
GOLDEN_TOKENS = pytest.mark.parametrize("num_tokens", [FIRST_TOKENS, pytest.param(None, marks=pytest.mark.full)],
                                        ids=["first", "all"])


def load_golden(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def check_against_golden(loaded, golden: dict, backend: str, max_num_seqs: int, num_tokens: int | None = None,
                         **settings) -> None:
    """Greedy ids of every golden prompt, batched, equal transformers': the first ``num_tokens`` of each (all of
    them with None). ``settings``: more EngineConfig fields (a KV cache, backend options)."""
    model = LlamaModel.from_weights(loaded.config, loaded.weights)
    # the reference configuration, pinned: kvcore's automatic choice may run a quantized file in bfloat16
    config = EngineConfig(backend=backend, max_num_seqs=max_num_seqs, dtype="float32", weights="float", lm_head="dense",
                          **settings)
    engine = Engine(model, loaded.tokenizer, config)
    prompts = golden["prompts"]
    for p in prompts:  # our tokenizer agrees with transformers' on every golden prompt
        assert loaded.tokenizer.encode(p["prompt"], add_bos=golden["add_bos_token"]) == p["prompt_token_ids"], p["name"]
    num_tokens = num_tokens or golden["max_new_tokens"]
    params = SamplingParams(max_new_tokens=num_tokens, ignore_eos=True)
    results = engine.generate([p["prompt_token_ids"] for p in prompts], params)
    for p, r in zip(prompts, results):
        assert r.token_ids == p["token_ids"][:num_tokens], f"{backend}: prompt '{p['name']}' diverges from transformers"
