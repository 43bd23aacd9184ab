"""Streaming detokenisation: one generated id at a time in, final text out, never half a character."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["StreamDecoder"]

_REPLACEMENT_CHAR = "\ufffd"


class Decodes(Protocol):
    """What the decoder needs of a tokenizer (:class:`~kvcore.text.tokenizer.Tokenizer` is one)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class StreamDecoder:
    """Incremental detokeniser: feed generated ids one at a time, get text as soon as it is final.

    A byte-level token can end in the middle of a multi-byte UTF-8 character (an emoji is often 2-4
    tokens), and some decoders treat the first token specially (SentencePiece drops its leading
    space). So each push decodes a short window of recent ids together and emits only the new part
    that is stable: the text minus any trailing U+FFFD, which may still complete with the next token.
    """

    #: ids kept as left context once everything before them has been emitted
    _CONTEXT = 4

    def __init__(self, tokenizer: Decodes, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []  # the decode window: left context + not-yet-final ids
        self._emitted = 0  # characters of decode(self._ids) already returned

    def _decode(self) -> str:
        return self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (often "", never a partial character)."""
        self._ids.append(int(token_id))
        text = self._decode()
        stable = text.rstrip(_REPLACEMENT_CHAR)
        new = stable[self._emitted :]
        self._emitted = max(self._emitted, len(stable))
        if len(stable) == len(text) and len(self._ids) > 2 * self._CONTEXT:
            # all text is final: slide the window so each push stays O(1)
            self._ids = self._ids[-self._CONTEXT :]
            self._emitted = len(self._decode())
        return new

    def flush(self) -> str:
        """Return whatever is still held back (a truly invalid byte sequence comes out as U+FFFD)."""
        text = self._decode()
        rest = text[self._emitted :]
        self._ids = []
        self._emitted = 0
        return rest
