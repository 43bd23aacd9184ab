"""Tokenizers built from GGUF vocabularies equal their reference on multilingual text: a SentencePiece BPE
model trained here with ``sentencepiece`` (the reference is SentencePiece itself), and byte-level BPE
vocabularies trained here with ``tokenizers`` behind each pre-tokenizer a model can declare in
``tokenizer.ggml.pre`` (the reference is the ``tokenizers`` pipeline of that model's tokenizer.json)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import gguf
import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from kvcore.loaders.gguf import load_gguf_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 12:45, and we'll meet at 1,000 places!",
    "Die Straße ist nass, weil es regnet. Übermorgen fahren wir nach München.",
    "Le café est très chaud ; l'hôtel se trouve près de la gare.",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "这是一个测试句子，用来训练分词器。我们喜欢学习新的语言。",
    "日本語のテキストも少し含まれています。東京は大きな都市です。",
    "한국어 문장도 있습니다. 서울은 아름다운 도시입니다.",
    "النص العربي موجود أيضا في هذه المجموعة.",
    "def main():\n    print(\"hello, world\")  # code\n\treturn 0\n",
    "Emoji 😀🎉 and math ∑ x² ≤ 42; numbers 3.14159 2024 1000000.",
] * 4
TEXTS = [
    "Hello, world! The fox's café is in München; 12345 and 3.14.",
    "  leading spaces and    inner   runs\n\nnew lines\ttabs ",
    "这是测试。日本語と한국어, русский текст, العربية 😀👍🏽",
    "Übermäßig große Wörter: Donaudampfschifffahrt 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n",
    "unseen characters: ☃ ✓ ǅ ₿ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


def _write_vocab_gguf(path: Path, write) -> Path:
    w = gguf.GGUFWriter(path, "llama")
    write(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# -- SentencePiece ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sentencepiece_model():
    spm = pytest.importorskip("sentencepiece")
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(  # Llama's settings: BPE, byte fallback, digits split, spaces kept
        sentence_iterator=iter(CORPUS), model_writer=buffer, vocab_size=700, model_type="bpe",
        byte_fallback=True, split_digits=True, character_coverage=0.98, normalization_rule_name="identity",
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, add_dummy_prefix=True,
        minloglevel=3,
    )
    return spm.SentencePieceProcessor(model_proto=buffer.getvalue())


def _spm_gguf(sp, path: Path) -> Path:
    """The vocabulary as llama.cpp's converter writes it (_set_vocab_sentencepiece)."""

    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return gguf.TokenType.UNKNOWN
        if sp.is_control(i):
            return gguf.TokenType.CONTROL
        if sp.is_byte(i):
            return gguf.TokenType.BYTE
        return gguf.TokenType.NORMAL

    def write(w: gguf.GGUFWriter) -> None:
        n = sp.get_piece_size()
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list([sp.id_to_piece(i) for i in range(n)])
        w.add_token_scores([sp.get_score(i) for i in range(n)])
        w.add_token_types([kind(i) for i in range(n)])
        w.add_bos_token_id(sp.bos_id())
        w.add_eos_token_id(sp.eos_id())
        w.add_unk_token_id(sp.unk_id())
        w.add_add_space_prefix(True)

    return _write_vocab_gguf(path, write)


def test_sentencepiece_vocabulary_matches_sentencepiece(sentencepiece_model, tmp_path):
    sp = sentencepiece_model
    tok = load_gguf_tokenizer(_spm_gguf(sp, tmp_path / "spm.gguf"))
    assert tok.bos_token_id == sp.bos_id() and tok.add_bos  # llama.cpp's SentencePiece default
    assert sp.eos_id() in tok.eos_token_ids
    byte_fallbacks = 0
    for text in TEXTS:
        want = sp.encode(text)
        assert tok.encode(text, add_bos=False) == want, repr(text)
        assert tok.encode(text) == [sp.bos_id(), *want]
        assert tok.decode(want) == sp.decode(want), repr(text)
        byte_fallbacks += sum(sp.is_byte(i) for i in want)
    assert byte_fallbacks > 0  # the texts exercise characters outside the vocabulary


# -- byte-level BPE behind each declared pre-tokenizer ------------------------------------------------------
LLAMA3_REGEX = (  # Llama 3's tokenizer.json
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (  # Qwen2 / Qwen2.5 / Qwen3's tokenizer.json
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split(regex: str):
    return [pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]


PIPELINES = {  # tokenizer.ggml.pre -> (normalizer, pre-tokenizer steps) of the model's tokenizer.json
    "gpt2": (None, [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
    "smollm": (None, [pre_tokenizers.Digits(individual_digits=True),
                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
    "llama-bpe": (None, _split(LLAMA3_REGEX)),
    "qwen2": (normalizers.NFC(), _split(QWEN2_REGEX)),
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _reference_bpe(pre: str) -> tokenizers.Tokenizer:
    normalizer, steps = PIPELINES[pre]
    tok = tokenizers.Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


@pytest.mark.parametrize("pre", list(PIPELINES))
def test_byte_level_bpe_matches_reference(pre, tmp_path):
    reference = _reference_bpe(pre)
    spec = json.loads(reference.to_str())["model"]
    vocab = spec["vocab"]
    tokens = sorted(vocab, key=vocab.get)

    def write(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["merges"]])
        w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
        w.add_eos_token_id(vocab["<|im_end|>"])
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")

    tok = load_gguf_tokenizer(_write_vocab_gguf(tmp_path / f"{pre}.gguf", write))
    for text in [*TEXTS, "<|im_start|>user\n你好 1234<|im_end|>"]:
        want = reference.encode(text, add_special_tokens=False).ids
        assert tok.encode(text) == want, (pre, text)
        assert tok.decode(want, skip_special_tokens=False) == reference.decode(want, skip_special_tokens=False)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>hi<|im_end|>"
    assert tok.eos_token_ids == [vocab["<|im_end|>"]]


def test_end_of_turn_tokens_from_the_file_end_generation(tmp_path):
    reference = _reference_bpe("gpt2")
    spec = json.loads(reference.to_str())["model"]
    vocab = spec["vocab"]
    tokens = sorted(vocab, key=vocab.get)

    def write(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_merges([" ".join(m) if not isinstance(m, str) else m for m in spec["merges"]])
        w.add_eos_token_id(vocab["<|endoftext|>"])
        w.add_eot_token_id(vocab["<|im_end|>"])

    tok = load_gguf_tokenizer(_write_vocab_gguf(tmp_path / "eot.gguf", write))
    assert tok.eos_token_ids == [vocab["<|endoftext|>"], vocab["<|im_end|>"]]
