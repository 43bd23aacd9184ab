"""Chat's sampling defaults (kvcore.sampling.chat_defaults): where they come from, when they apply, and that the
default model's chat answers to everyday questions no longer loop (issue #54)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from helpers import last_json, run_cli

from kvcore.cli.generate import chat_params
from kvcore.errors import ModelLoadError
from kvcore.interfaces.sampler import SamplingParams
from kvcore.loaders.recommended import from_generation_config, from_gguf
from kvcore.sampling.chat_defaults import CHAT_DEFAULTS, ChatDefaults, chat_defaults
from kvcore.serving.protocol import parse_chat, parse_completion

TINY = str(Path(__file__).parents[1] / "data" / "tiny-llama")
FAST = ["--model", TINY, "--backend", "sdpa", "--max-new-tokens", "6", "--ignore-eos", "--json"]
QUESTIONS = ["What is the capital of France?", "What is the capital of Italy?", "Write a haiku about the sea.",
             "How do I reverse a list in Python?"]


def max_ngram_repeats(ids: list[int], n: int = 4) -> int:
    """How often the most frequent run of ``n`` token ids occurs in ``ids``."""
    return max(Counter(tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)).values(), default=0)


def is_loop(ids: list[int], n: int = 4, limit: int = 3) -> bool:
    """A reply that says the same ``n``+ tokens more than ``limit`` times is stuck in a loop."""
    return max_ngram_repeats(ids, n) > limit


def test_the_loop_check_catches_a_loop_and_passes_an_answer():
    assert is_loop([5, 6] + [7, 8, 9, 10] * 4)
    assert not is_loop([7, 8, 9, 10] * 3 + list(range(20, 40)))


# -- the defaults object ----------------------------------------------------------------------------------
def test_defaults_fill_only_what_is_unset_and_temperature_0_stays_greedy():
    filled = CHAT_DEFAULTS.fill({"temperature": None, "top_k": 5, "seed": 3})
    assert filled == {**CHAT_DEFAULTS.settings(), "top_k": 5, "seed": 3}
    assert SamplingParams(**filled).repetition_window == 64
    assert CHAT_DEFAULTS.fill({"temperature": 0.0, "top_k": None}) == {"temperature": 0.0, "top_k": None}
    assert CHAT_DEFAULTS.fill({"temperature": 1.2})["temperature"] == 1.2


def test_a_models_recommendation_replaces_only_what_it_gives():
    class Tok:
        recommended_sampling = {"temperature": 0.6, "top_p": 0.95}

    d = chat_defaults(Tok(), "qwen")
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty) == (0.6, 0.95, 40, 1.1)
    assert "qwen's recommended temperature, top_p" in d.source
    assert chat_defaults(object()) is CHAT_DEFAULTS


def test_recommended_settings_from_gguf_keys_and_generation_config():
    meta = {"general.sampling.temp": 0.7, "general.sampling.top_k": 20, "general.sampling.top_p": 0.8,
            "general.sampling.penalty_repeat": 1.05, "general.sampling.penalty_last_n": 128, "general.name": "x"}
    assert from_gguf(meta, "m.gguf") == {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05,
                                         "repetition_window": 128}
    assert from_gguf({"general.sampling.penalty_last_n": -1}, "m.gguf") == {"repetition_window": None}  # all
    assert from_gguf({"general.sampling.penalty_last_n": 0}, "m.gguf") == {"repetition_penalty": 1.0}  # off
    generation = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": None, "eos_token_id": 2}
    assert from_generation_config(generation, "dir") == {"temperature": 0.6, "top_p": 0.9}
    assert from_generation_config(None, "dir") == {}
    with pytest.raises(ModelLoadError, match="general.sampling.top_p is not a usable sampling setting"):
        from_gguf({"general.sampling.top_p": 1.5}, "m.gguf")


def test_a_hugging_face_directory_carries_its_generation_config(tmp_path):
    import shutil

    from kvcore.loaders import load_model

    shutil.copytree(TINY, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text('{"eos_token_id": 1, "temperature": 0.3, "top_k": 7}')
    assert load_model(str(tmp_path / "m")).tokenizer.recommended_sampling == {"temperature": 0.3, "top_k": 7}
    assert load_model(TINY).tokenizer.recommended_sampling == {}  # do_sample only: nothing recommended


# -- the CLI ----------------------------------------------------------------------------------------------
def test_chat_samples_with_the_defaults_and_a_seed_reproduces_it(capsys):
    rc, out, err = run_cli(capsys, "chat", *FAST, "--verbose", "--seed", "5", "hi")
    assert rc == 0 and "chat sampling: temperature 0.8, top_k 40, top_p 0.9" in err
    again = last_json(run_cli(capsys, "chat", *FAST, "--seed", "5", "hi")[1])
    assert again["token_ids"] == last_json(out)["token_ids"]


def test_chat_flags_win_and_temperature_0_is_the_greedy_stream(capsys):
    rc, out, err = run_cli(capsys, "chat", *FAST, "--verbose", "--top-k", "3", "hi")
    shown = next(line for line in err.splitlines() if "chat sampling:" in line)
    assert rc == 0 and "top_k" not in shown and "temperature 0.8" in shown
    rc, out, err = run_cli(capsys, "chat", *FAST, "--verbose", "--temperature", "0", "hi")
    assert rc == 0 and "chat sampling" not in err
    from kvcore import Engine, EngineConfig

    greedy = last_json(out)
    engine = Engine.from_pretrained(TINY, EngineConfig(backend="sdpa"))
    want = engine.generate([greedy["prompt_token_ids"]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert greedy["token_ids"] == want.token_ids  # exactly the greedy stream, no penalty added


# -- the server -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from kvcore.loaders import load_model

    return load_model(TINY).tokenizer


def _chat(tokenizer, **body):
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    return parse_chat(body, tokenizer, vocab_size=256, max_model_len=256, max_prompt_chars=10_000).params


def test_chat_completions_use_the_chat_defaults_where_the_request_is_silent(tokenizer):
    p = _chat(tokenizer)
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.repetition_window) == (0.8, 40, 0.9, 1.1, 64)
    p = _chat(tokenizer, temperature=1.0, top_p=0.5, repetition_window=8)
    assert (p.temperature, p.top_k, p.top_p, p.repetition_window) == (1.0, 40, 0.5, 8)
    p = _chat(tokenizer, temperature=0)  # greedy, as OpenAI clients mean it: nothing else added
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.repetition_window) == (0.0, 0, 1.0, 1.0, None)
    completion = parse_completion({"prompt": "hi"}, tokenizer, vocab_size=256, max_model_len=256,
                                  max_prompt_chars=10_000).params
    assert (completion.temperature, completion.top_k, completion.repetition_penalty) == (1.0, 0, 1.0)  # OpenAI's


# -- as a user asks the default model ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def default_engine():
    from kvcore import Engine, EngineConfig

    return Engine.from_pretrained("smollm2", EngineConfig(max_num_seqs=1))  # `kvcore chat`'s defaults


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("question", QUESTIONS)
def test_everyday_questions_do_not_loop_with_the_chat_defaults(default_engine, question, seed):
    """Plain greedy decoding loops on two of these (``la République, la République, ...`` to the 128-token
    limit); the chat defaults, as ``kvcore chat --seed`` builds them, answer each without a loop."""
    params = chat_params(SamplingParams(seed=seed), {"model": "smollm2", "seed": seed}, default_engine.tokenizer)
    result = default_engine.chat([{"role": "user", "content": question}], params)
    assert not is_loop(result.token_ids), (result.finish_reason, result.text)
    assert result.finish_reason.value == "eos" or max_ngram_repeats(result.token_ids) <= 2, result.text


def test_chat_defaults_are_documented():
    docs = Path(__file__).parents[2] / "docs"
    for page in ("cli.md", "serving.md"):
        text = (docs / page).read_text()
        assert "CHAT_DEFAULTS" in text and "repetition_window" in text, page
    assert isinstance(CHAT_DEFAULTS, ChatDefaults)
