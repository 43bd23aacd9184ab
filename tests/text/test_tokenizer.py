"""Tokenizer: SmolLM2's GGUF tokenizer against transformers', chat templates, streaming decode."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from helpers import FastGGUFReader
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.errors import ConfigError, InvalidRequestError, ModelNotFoundError
from kvcore.loaders import resolve
from kvcore.loaders.gguf import load_gguf_tokenizer
from kvcore.text.tokenizer import Tokenizer
from kvcore.text.vocab import byte_level_bpe

STRINGS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing   ",
    "multiple\n\nnewlines\n\n\n and\ttabs\t\there\r\n",
    "12345",
    "3.14159 + 2.71828 = 5.85987; x=10, y=-42, 1,000,000",
    " 123 abc 4567",
    "a1b2c3",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    '{"key": [1, 2, {"nested": null}]}',
    "I'm sure it's what they'd've wanted, isn't it? We'll see. You're right.",
    "你好，世界！这是一个测试。",
    "日本語のテキストと한국어 텍스트",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "Ünïcödé àccénts: naïve café, Straße, Ελληνικά, русский",
    "math: ∑_{i=1}^{n} i² = n(n+1)/2, ∞ ≠ ∅",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after end<|im_end|><|im_start|>",
    "not special: <|im_star|> <im_end> |im_end|",
    "<repo_name>kvcore<file_sep>main.py",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "a" * 300,
    "    \n    \n\n\n      x",
]

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Where is the gold?"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3? 你好 😀"},
    ],
]


@pytest.fixture(scope="module")
def smollm2_file() -> Path:
    try:
        return resolve.smollm2_path()
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def tok(smollm2_file: Path) -> Tokenizer:
    return load_gguf_tokenizer(smollm2_file)


@pytest.fixture(scope="module")
def hf_tok(smollm2_file: Path):
    transformers = pytest.importorskip("transformers")
    with pytest.MonkeyPatch.context() as mp:
        # speed only: the stock reader's memmap slicing makes parsing the 49k-token vocabulary slow;
        # this subclass reads the same bytes through a plain ndarray view
        mp.setattr(gguf, "GGUFReader", FastGGUFReader)
        return transformers.AutoTokenizer.from_pretrained(
            str(smollm2_file.parent), gguf_file=smollm2_file.name
        )


# --------------------------------------------------------------------------- SmolLM2 vs transformers


@pytest.mark.slow
def test_encode_matches_transformers(tok: Tokenizer, hf_tok) -> None:
    for text in STRINGS:
        assert tok.encode(text) == hf_tok.encode(text), repr(text)
        assert tok.encode(text) == hf_tok(text)["input_ids"], repr(text)


@pytest.mark.slow
def test_decode_matches_transformers(tok: Tokenizer, hf_tok) -> None:
    for text in STRINGS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), repr(text)


@pytest.mark.slow
def test_chat_template_matches_transformers(tok: Tokenizer, hf_tok) -> None:
    for messages in CONVERSATIONS:
        for gen in (True, False):
            expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == expected
        prompt = tok.apply_chat_template(messages)
        expected_ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        assert tok.encode(prompt) == list(expected_ids["input_ids"])


@pytest.mark.slow
def test_special_ids_match_transformers(tok: Tokenizer, hf_tok) -> None:
    assert tok.bos_token_id == hf_tok.bos_token_id == 1  # the GGUF says <|im_start|>
    assert hf_tok.eos_token_id == 2
    assert tok.eos_token_ids == [2]  # <|im_end|> is both EOS and the template's end of turn
    assert tok.pad_token_id == hf_tok.pad_token_id == 2
    assert tok.vocab_size == len(hf_tok) == 49152


# --------------------------------------------------------------------------- SmolLM2 on its own


def test_smollm2_basics(tok: Tokenizer) -> None:
    assert tok.add_bos is False  # tokenizer.ggml.add_bos_token = false
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert tok.encode("12345") == [33, 34, 35, 36, 37]  # one token per digit
    assert tok.encode("hi", add_bos=True) == [1, 6004]
    assert tok.encode("<|im_start|>hi", add_bos=True)[:2] == [1, 6004]  # BOS not doubled
    assert tok.decode([1, 6004, 2]) == "hi"
    assert tok.decode([1, 6004, 2], skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"
    with pytest.raises(InvalidRequestError, match="lone surrogate"):
        tok.encode("bad \ud800 text")


def test_roundtrip(tok: Tokenizer) -> None:
    for text in STRINGS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    decoder = tok.stream_decoder()
    pieces = [decoder.push(i) for i in ids]
    pieces.append(decoder.flush())
    return pieces


def test_stream_decoder_reassembles_split_characters(tok: Tokenizer) -> None:
    text = "Emoji 😀🎉👍🏽 and 你好世界, then 👨‍👩‍👧‍👦 done."
    ids = tok.encode(text)
    # the test is only meaningful if some characters really are split across tokens
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert pieces[-1] == ""  # everything was final before flush


def test_stream_decoder_long_text_and_specials(tok: Tokenizer) -> None:
    text = "\n".join(STRINGS)
    ids = tok.encode(text)
    assert "".join(_stream(tok, ids)) == tok.decode(ids)
    decoder = tok.stream_decoder(skip_special_tokens=False)
    assert "".join([decoder.push(i) for i in ids] + [decoder.flush()]) == text


def test_stream_decoder_flushes_incomplete_bytes(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀")
    decoder = tok.stream_decoder()
    out = "".join(decoder.push(i) for i in ids[:-1])
    assert out == "ok "  # the emoji's leading bytes are held back
    assert decoder.flush() == tok.decode(ids[:-1])[len(out) :]  # invalid bytes come out as U+FFFD
    assert decoder.flush() == ""


# SmolLM2's vocabulary has no token for bytes 0x04 0x06 0x13 0x14 0x16 0x1D 0xF1 0xF2 (nor for the
# bytes UTF-8 never uses), so text containing them cannot round-trip (transformers drops them too)
_ENCODABLE = st.characters(
    max_codepoint=0x3FFFF, exclude_characters="\x04\x06\x13\x14\x16\x1d", exclude_categories=("Cs",)
)


@settings(max_examples=60, deadline=None)
@given(text=st.text(_ENCODABLE, max_size=40))
def test_roundtrip_and_stream_property(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    decoder = tok.stream_decoder(skip_special_tokens=False)
    assert "".join([decoder.push(i) for i in ids] + [decoder.flush()]) == text


# --------------------------------------------------------------------------- small hand-built tokenizers


def _tiny(**kwargs) -> Tokenizer:
    tokens = ["<|endoftext|>", "<s>", "<|eot_id|>"] + [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ"]
    return Tokenizer(byte_level_bpe(tokens, [], [3, 3, 3] + [1] * (len(tokens) - 3), None), **kwargs)


def test_no_chat_template_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no chat template"):
        _tiny().apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_raise_exception_and_bad_messages() -> None:
    check = "{{ raise_exception('first message must be user') }}"
    template = "{% if messages[0]['role'] != 'user' %}" + check + "{% endif %}x"
    tok = _tiny(chat_template=template)
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "x"
    with pytest.raises(InvalidRequestError, match="first message must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "a"}])
    with pytest.raises(InvalidRequestError, match="list of"):
        tok.apply_chat_template("hi")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="invalid Jinja"):
        _tiny(chat_template="{% for %}").apply_chat_template([{"role": "user", "content": "a"}])


def test_template_variables_and_end_of_turn() -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m.content | tojson }}<|eot_id|>{% endfor %}{{ eos_token }}"
    )
    tok = _tiny(chat_template=template, bos_token_id=1, eos_token_ids=[0])
    assert tok.eos_token_ids == [0, 2]  # EOS plus the template's end-of-turn special token
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '<s>"é"<|eot_id|><|endoftext|>'
    assert _tiny(bos_token_id=1, eos_token_ids=[0]).eos_token_ids == [0]


def test_from_file(tmp_path: Path, tok: Tokenizer) -> None:
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "chat_template": tok.chat_template,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = Tokenizer.from_file(tmp_path / "tokenizer.json", tokenizer_config=config, eos_token_ids=[0])
    assert (loaded.bos_token_id, loaded.eos_token_ids, loaded.pad_token_id, loaded.add_bos) == (
        1,
        [0, 2],
        2,
        False,
    )
    for text in STRINGS:
        assert loaded.encode(text) == tok.encode(text)
    messages = CONVERSATIONS[1]
    assert loaded.apply_chat_template(messages) == tok.apply_chat_template(messages)
    # no add_bos_token flag: inferred from whether tokenizer.json's post-processor adds BOS
    backend = tok.backend
    from tokenizers import processors

    backend_copy = type(backend).from_str(backend.to_str())
    backend_copy.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    backend_copy.save(str(tmp_path / "bos.json"))
    with_bos = Tokenizer.from_file(tmp_path / "bos.json", tokenizer_config={"bos_token": "<|im_start|>"})
    assert with_bos.add_bos is True
    assert with_bos.encode("hi") == [1, 6004]


def test_from_file_errors(tmp_path: Path) -> None:
    from kvcore.errors import ModelLoadError

    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read tokenizer"):
        Tokenizer.from_file(bad)
