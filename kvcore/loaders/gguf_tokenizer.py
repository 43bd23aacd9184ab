"""The tokenizer of a GGUF file's ``tokenizer.ggml.*`` metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcore.errors import ModelLoadError
from kvcore.loaders.recommended import from_gguf
from kvcore.text.tokenizer import Tokenizer
from kvcore.text.vocab import byte_level_bpe, sentencepiece_bpe

__all__ = ["gguf_tokenizer"]


def gguf_tokenizer(metadata: dict[str, Any], path: Path) -> Tokenizer:
    """The tokenizer of ``tokenizer.ggml.*``: byte-level BPE (``gpt2``) or SentencePiece (``llama``), with
    the file's chat template and recommended sampling settings (``general.sampling.*``); its end-of-turn tokens
    (``eot``/``eom``) end generation like EOS."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelLoadError(
            f"'{path}': unsupported tokenizer model '{kind}' (supported: gpt2 = byte-level BPE, llama = SentencePiece)"
        )
    tokens = _array(metadata, "tokens", str, path)
    if not tokens:
        raise ModelLoadError(f"'{path}': GGUF has no tokenizer.ggml.tokens")
    for key in ("scores", "token_type"):  # per-token arrays: one entry per token when present
        values = _array(metadata, key, (int, float) if key == "scores" else int, path)
        if values is not None and len(values) != len(tokens):
            raise ModelLoadError(
                f"'{path}': tokenizer.ggml.{key} has {len(values)} entries for {len(tokens)} tokens"
            )

    def token_id(name: str) -> int | None:
        key = f"tokenizer.ggml.{name}_token_id"
        value = metadata.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens):
            raise ModelLoadError(f"'{path}': {key} is {value!r}, not a token id (0 to {len(tokens) - 1})")
        return value

    eos = [i for i in (token_id("eos"), token_id("eot"), token_id("eom")) if i is not None]
    types = metadata.get("tokenizer.ggml.token_type")
    common = dict(
        bos_token_id=token_id("bos"),
        eos_token_ids=eos,
        pad_token_id=token_id("padding"),
        chat_template=metadata.get("tokenizer.chat_template"),
        recommended_sampling=from_gguf(metadata, str(path)),
    )
    if kind == "llama":
        backend = sentencepiece_bpe(
            tokens, metadata.get("tokenizer.ggml.scores"), types, token_id("unknown"),
            bool(metadata.get("tokenizer.ggml.add_space_prefix", True)),
        )
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", True))  # llama.cpp's SentencePiece default
        return Tokenizer(backend, add_bos=add_bos, **common)
    merges = _array(metadata, "merges", str, path)
    if merges is None:
        raise ModelLoadError(f"'{path}': GGUF has no tokenizer.ggml.merges for its BPE vocabulary")
    backend = byte_level_bpe(tokens, merges, types, metadata.get("tokenizer.ggml.pre"))
    return Tokenizer(backend, add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)), **common)


def _array(metadata: dict[str, Any], key: str, kind: type | tuple[type, ...], path: Path) -> list | None:
    """``tokenizer.ggml.{key}`` when it is a list of ``kind`` (None when absent); ModelLoadError otherwise."""
    values = metadata.get(f"tokenizer.ggml.{key}")
    if values is None:
        return None
    if not isinstance(values, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
        what = kind.__name__ if isinstance(kind, type) else "number"
        raise ModelLoadError(f"'{path}': tokenizer.ggml.{key} must be an array of {what} values")
    return values
