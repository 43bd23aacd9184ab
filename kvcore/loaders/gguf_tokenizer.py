"""The tokenizer of a GGUF file's ``tokenizer.ggml.*`` metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcore.errors import ModelLoadError
from kvcore.tokenizer import Tokenizer

__all__ = ["gguf_tokenizer"]


def gguf_tokenizer(metadata: dict[str, Any], path: Path) -> Tokenizer:
    """The tokenizer of ``tokenizer.ggml.*``: byte-level BPE (``gpt2``) or SentencePiece (``llama``), with
    the file's chat template; its end-of-turn tokens (``eot``/``eom``) end generation like EOS."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if kind not in ("gpt2", "llama"):
        raise ModelLoadError(
            f"'{path}': unsupported tokenizer model '{kind}' (supported: gpt2 = byte-level BPE, llama = SentencePiece)"
        )
    if not tokens:
        raise ModelLoadError(f"'{path}': GGUF has no tokenizer.ggml.tokens")

    def token_id(name: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{name}_token_id")
        return int(value) if value is not None else None

    eos = [i for i in (token_id("eos"), token_id("eot"), token_id("eom")) if i is not None]
    common = dict(
        token_types=metadata.get("tokenizer.ggml.token_type"),
        bos_token_id=token_id("bos"),
        eos_token_ids=eos,
        pad_token_id=token_id("padding"),
        chat_template=metadata.get("tokenizer.chat_template"),
    )
    if kind == "llama":
        return Tokenizer.from_sentencepiece_vocab(
            tokens,
            metadata.get("tokenizer.ggml.scores"),
            unk_token_id=token_id("unknown"),
            add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", True)),
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", True)),  # llama.cpp's SentencePiece default
            **common,
        )
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise ModelLoadError(f"'{path}': GGUF has no tokenizer.ggml.merges for its BPE vocabulary")
    return Tokenizer.from_bpe_vocab(
        tokens,
        merges,
        pre_tokenizer=metadata.get("tokenizer.ggml.pre"),
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        **common,
    )
