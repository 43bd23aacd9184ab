"""What a generated token turns into for the caller: incremental text, stop strings, and the events.

Stop strings (OpenAI's ``stop``) are searched in the decoded text, which the stream decoder only ever
produces in whole characters, so a cut never falls inside a UTF-8 character. Text that might be the
beginning of a stop string is held back until the next token decides it; the stop string and anything
after it are never returned.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcore.text.stream_decoder import StreamDecoder

__all__ = ["StopStrings", "TextOutput"]


class StopStrings:
    """Incremental search for the first of ``stops`` in a stream of text pieces."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._held = ""  # a suffix of the text so far that is a proper prefix of some stop string

    def push(self, text: str) -> tuple[str, bool]:
        """Add a piece; returns the text that is final now, and whether a stop string ended the stream
        (the returned text then stops right before it)."""
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = 0  # the longest suffix of buf that a stop string starts with
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back text, once the stream ended for another reason."""
        text, self._held = self._held, ""
        return text


@dataclass
class TextOutput:
    """The text side of one request: its stream decoder (None without a tokenizer) and stop strings."""

    decoder: StreamDecoder | None
    stop: StopStrings | None = None
    text: str = ""  # everything returned so far

    def push(self, token_id: int, finishing: bool) -> tuple[str, bool]:
        """The text ``token_id`` completes; with ``finishing`` also everything still held back. Second:
        whether a stop string was found (the request then ends with FinishReason.STOP)."""
        if self.decoder is None:
            return "", False
        text = self.decoder.push(token_id)
        if finishing:
            text += self.decoder.flush()
        hit = False
        if self.stop is not None:
            text, hit = self.stop.push(text)
            if finishing and not hit:
                text += self.stop.flush()
        self.text += text
        return text, hit
