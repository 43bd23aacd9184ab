"""``tokenizers`` backends built from GGUF vocabularies (llama.cpp's ``tokenizer.ggml.*`` metadata).

Two vocabulary kinds, as llama.cpp names them in ``tokenizer.ggml.model``:

* ``gpt2``: byte-level BPE (tokens spelled in GPT-2's byte alphabet, ``merges`` best first), split first by
  the pre-tokenizer the model declares in ``tokenizer.ggml.pre`` (its regex, as in the model's own
  ``tokenizer.json``);
* ``llama``: SentencePiece BPE (``▁`` for spaces, ``scores`` ranking the merges, ``<0xXX>`` byte pieces
  for characters outside the vocabulary), built the way transformers converts a SentencePiece model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

from kvcore.errors import ModelLoadError

__all__ = ["byte_level_bpe", "sentencepiece_bpe", "PRE_TOKENIZERS", "TOKEN_TYPE_CONTROL"]

logger = logging.getLogger(__name__)

#: llama.cpp's ``tokenizer.ggml.token_type`` values
TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_BYTE = 1, 2, 3, 4, 6

#: split regex of Llama 3 (``tokenizer.ggml.pre`` = llama3 / llama-bpe), as in its tokenizer.json
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: split regex of Qwen2 / Qwen2.5 / Qwen3 (``qwen2``): single digits, as in their tokenizer.json
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: ``tokenizer.ggml.pre`` names -> (split regex or None for GPT-2's built-in one, digits split singly, NFC)
PRE_TOKENIZERS: dict[str, tuple[str | None, bool, bool]] = {
    "default": (None, False, False),
    "gpt2": (None, False, False),
    "gpt-2": (None, False, False),
    "smollm": (None, True, False),
    "llama3": (_LLAMA3_SPLIT, False, False),
    "llama-bpe": (_LLAMA3_SPLIT, False, False),
    "llama-v3": (_LLAMA3_SPLIT, False, False),
    "qwen2": (_QWEN2_SPLIT, False, True),
}


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the spelling byte-level BPE vocabularies use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer(pre: str | None) -> tuple[pre_tokenizers.PreTokenizer, normalizers.Normalizer | None]:
    """The pre-tokenizer (and normalizer) of llama.cpp's ``tokenizer.ggml.pre`` name."""
    if pre is not None and pre not in PRE_TOKENIZERS:
        logger.warning("unknown GGUF pre-tokenizer %r: using GPT-2's byte-level split", pre)
    regex, single_digits, nfc = PRE_TOKENIZERS.get(pre or "default", PRE_TOKENIZERS["default"])
    steps: list[pre_tokenizers.PreTokenizer] = []
    if single_digits:  # SmolLM's tokenizer.json: every digit is its own pre-token, then GPT-2's regex
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if regex is not None:
        steps.append(pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex is None))
    pre_tok = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    return pre_tok, normalizers.NFC() if nfc else None


def _add_special(backend: tokenizers.Tokenizer, tokens: Sequence[str], types: Sequence[int] | None, ok) -> None:
    """Control tokens match whole as special tokens, user-defined ones as plain added tokens."""
    if types is None:
        return
    pairs = list(zip(tokens, types))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in pairs if k == TOKEN_TYPE_CONTROL and ok(t)]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in pairs if k == TOKEN_TYPE_USER_DEFINED and ok(t)]
    )


def byte_level_bpe(
    tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int] | None, pre: str | None
) -> tokenizers.Tokenizer:
    """A GPT-2 style byte-level BPE backend (``tokenizer.ggml.model = gpt2``)."""
    spelling = _byte_level_alphabet()
    alphabet = set(spelling.values())
    # llama.cpp sometimes stores added tokens as raw text; BPE looks tokens up in the byte
    # alphabet, so respell those (what transformers does too, keeping ids identical)
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ModelLoadError(f"malformed BPE merge {merge!r}: expected two tokens separated by a space")
        pairs.append((parts[0], parts[1]))
    try:
        model = models.BPE(
            vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
            fuse_unk=False,
        )
    except Exception as exc:  # the Rust side raises a bare Exception, e.g. a merge of unknown tokens
        raise ModelLoadError(f"invalid BPE vocabulary: {exc}") from None
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer, normalizer = _pre_tokenizer(pre)
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.decoder = decoders.ByteLevel()
    # a control token outside the byte alphabet is a llama.cpp mislabel: adding it would grow the
    # vocabulary past the embedding matrix
    _add_special(backend, tokens, token_types, lambda t: set(t) <= alphabet and t in vocab)
    return backend


def sentencepiece_bpe(
    tokens: Sequence[str],
    scores: Sequence[float] | None,
    token_types: Sequence[int] | None,
    unk_token_id: int | None,
    add_space_prefix: bool = True,
) -> tokenizers.Tokenizer:
    """A SentencePiece BPE backend (``tokenizer.ggml.model = llama``), as transformers converts a
    SentencePiece model: merges ranked by the merged piece's score, byte fallback, ``▁`` for spaces, and
    (``add_space_prefix``, SentencePiece's ``add_dummy_prefix``) a ``▁`` before the text."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError("SentencePiece vocabulary has duplicate pieces")
    scores = list(scores) if scores is not None else [-float(i) for i in range(len(tokens))]
    types = list(token_types) if token_types is not None else [TOKEN_TYPE_NORMAL] * len(tokens)
    mergeable = {t for t, k in zip(tokens, types) if k in (TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED)}
    merges = []
    for piece, score in zip(tokens, scores):  # every split of a piece into two pieces is a merge
        if piece not in mergeable:
            continue
        local = [(piece[:j], piece[j:]) for j in range(1, len(piece))]
        local = [(left, right) for left, right in local if left in vocab and right in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend((left, right, score) for left, right in local)
    merges.sort(key=lambda m: m[2], reverse=True)  # stable: ties keep vocabulary order
    unk = tokens[unk_token_id] if unk_token_id is not None and 0 <= unk_token_id < len(tokens) else None
    try:
        model = models.BPE(
            vocab=vocab, merges=[m[:2] for m in merges], unk_token=unk, fuse_unk=True, byte_fallback=True,
            dropout=None,
        )
    except Exception as exc:
        raise ModelLoadError(f"invalid SentencePiece vocabulary: {exc}") from None
    backend = tokenizers.Tokenizer(model)
    # transformers' "legacy" SentencePiece normalizer, which is also llama.cpp's behaviour: the ▁ prefix on
    # every text segment, so also after a special token ("<s>[INST]" -> "<s>", "▁[", ...)
    replace = normalizers.Replace(" ", "▁")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace]) if add_space_prefix else replace
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    specials = [t for t, k in zip(tokens, types) if k == TOKEN_TYPE_UNKNOWN]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    _add_special(backend, tokens, types, lambda t: True)
    return backend
