"""Structured output: constrain generation to a JSON schema, any JSON object, a regex, one of several strings,
or a grammar (Lark or llama.cpp's GBNF), with llguidance (the optional extra ``kvcore[structured]``).

:class:`~kvcore.interfaces.structured.StructuredOutput` says what the output must match (a field of
:class:`~kvcore.interfaces.sampler.SamplingParams`).
:class:`GrammarCompiler` turns it into a matcher per request; compilation is cached per grammar text (the full
text is the key). Each step :func:`apply_grammar_masks` computes every constrained row's allowed tokens in one
call (llguidance's parallel executor writes a ``[R, ceil(V / 32)]`` bitmask) and masks the logits of the whole
batch with one tensor operation, before the sampler runs: the constraint composes with every sampler, batch
and backend. The engine then feeds each sampled token back to its row's matcher.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvcore.errors import GrammarError, InvalidRequestError
from kvcore.interfaces.structured import StructuredOutput
from kvcore.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    import llguidance

__all__ = ["GrammarCompiler", "apply_grammar_masks", "dead_end", "grammar_text", "STRUCTURED_INSTALL", "JSON_OPTIONS"]

STRUCTURED_INSTALL = "pip install 'kvcore[structured]'"
#: JSON is written compactly (no free whitespace): a model cannot wander off into spaces and newlines
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar ``structured`` compiles to (the compile cache's key).

    :raises GrammarError: llguidance cannot read it (JSON it does not accept, such as NaN, 1e999 or a lone
        surrogate escape, which Python's json module lets through; text that is not valid UTF-8).
    """
    try:
        return _grammar_text(structured)
    except (ValueError, UnicodeError) as exc:  # llguidance's own parsers, stricter than the checks before
        raise GrammarError(f"{_what(structured)}: {_one_line(str(exc))}") from None


def _grammar_text(structured: StructuredOutput) -> str:
    ll = _llguidance()
    matcher = ll.LLMatcher
    if structured.json is not None:
        return matcher.grammar_from_json_schema(structured.json, defaults=JSON_OPTIONS)
    if structured.json_object:
        return matcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if structured.regex is not None:
        return matcher.grammar_from_regex(structured.regex)
    if structured.choice is not None:
        # one terminal (a single lexeme, as a JSON enum compiles), not one rule alternative per string: the
        # parser keeps an item per alternative, and past 2000 of them llguidance stops at the first token
        return matcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(map(json.dumps, structured.choice)))
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(structured.grammar)
    except Exception as exc:  # the converter raises its own exception types for a malformed GBNF
        raise GrammarError(f"grammar: not valid GBNF or Lark: {exc}") from None
    return matcher.grammar_from_lark(lark)




def _llguidance():
    try:
        import llguidance
        import llguidance.torch  # noqa: F401  (the bitmask helpers)
    except ImportError:
        raise InvalidRequestError(f"structured output needs llguidance: {STRUCTURED_INSTALL}") from None
    return llguidance


class GrammarCompiler:
    """Compiles :class:`StructuredOutput` constraints for one tokenizer; the compiled matchers are cached per
    grammar text (LRU, ``max_cached`` entries) and each request gets its own copy.

    :param tokenizer: a :class:`~kvcore.text.tokenizer.Tokenizer` (its ``tokenizers`` backend is what llguidance
        reads); :param vocab_size: the width of the model's logits; :param eos_token_ids: the tokens that end
        a constrained output once it is complete.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int], max_cached: int = 128
                 ) -> None:
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._eos = sorted(eos_token_ids)
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._executor = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self.max_cached = max_cached
        self.num_compiled = 0  # grammars compiled (cache misses)

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._lltokenizer is None:
            ll = _llguidance()
            self._lltokenizer = ll.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                               eos_token=self._eos or None)
            self._executor = ll.LLExecutor()
        return self._lltokenizer

    def matcher(self, structured: StructuredOutput) -> Any:
        """A fresh matcher (llguidance ``LLMatcher``) at the start of ``structured``'s grammar.

        :raises GrammarError: the schema, regex or grammar is malformed (the message says where).
        """
        grammar = grammar_text(structured)
        compiled = self._cache.get(grammar)
        if compiled is None:
            ll = _llguidance()
            compiled = ll.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
            if compiled.is_error():
                raise GrammarError(f"{_what(structured)}: {_one_line(compiled.get_error())}")
            # the first mask, once per grammar: a constraint no text satisfies ([^\s\S]) or one too big for the
            # parser fails here, before any work, instead of ending the output empty or failing mid-generation
            probe = compiled.deep_copy()
            self.fill_bitmask([probe])
            if probe.is_error():
                raise GrammarError(f"{_what(structured)}: {dead_end(probe)}")
            self.num_compiled += 1
            self._cache[grammar] = compiled
            if len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(grammar)
        return compiled.deep_copy()

    def fill_bitmask(self, matchers: Sequence[Any]) -> torch.Tensor:
        """``[R, ceil(V / 32)]`` int32: bit ``t % 32`` of word ``t // 32`` of row ``i`` is set when token ``t``
        is allowed next by ``matchers[i]``; computed for all rows in one parallel call."""
        import llguidance.torch as lt

        self._ll_tokenizer()
        bitmask = lt.allocate_token_bitmask(len(matchers), self.vocab_size)
        lt.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        return bitmask


def dead_end(matcher: Any) -> str:
    """Why a matcher in error allows no token, in one line (llguidance's error goes on with its state and the
    whole grammar)."""
    reason = matcher.get_error().strip().split("\n", 1)[0]
    if reason == "NoExtensionBias":  # the mask is empty: no text that starts with the output so far matches
        return "no text can match it"
    return reason if len(reason) <= 300 else reason[:297] + "..."


def _one_line(message: str) -> str:
    """llguidance's error, without the source excerpt and caret lines it draws under it."""
    lines = [ln.strip() for ln in message.splitlines()]
    kept = [ln for ln in lines if ln and not set(ln) <= {"^", " "} and not re.match(r"^\d+ \|", ln)]
    return " ".join(kept)


def _what(structured: StructuredOutput) -> str:
    return {"json": "json schema", "json_object": "json object", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}[structured.kind]


#: byte value -> which of its 8 bits (least significant first) are 0: the forbidden tokens of one mask byte
_FORBIDDEN = (torch.arange(256)[:, None] >> torch.arange(8)) & 1 == 0  # [256, 8]


def apply_grammar_masks(logits: torch.Tensor, rows: Sequence[Any], compiler: GrammarCompiler | None) -> None:
    """Set to -inf, in place, the logits ``[B, V]`` of every token a constrained row's grammar forbids next.
    ``rows[i].matcher`` is the row's matcher, or None for an unconstrained row (left as it is)."""
    picked = [i for i, r in enumerate(rows) if getattr(r, "matcher", None) is not None]
    if not picked or compiler is None:
        return
    bitmask = compiler.fill_bitmask([rows[i].matcher for i in picked])  # [R, W] int32
    vocab = logits.shape[-1]
    # the int32 words read as bytes (little-endian: bit t % 32 of a word is bit t % 8 of byte (t % 32) // 8),
    # each byte looked up as 8 booleans: one gather for the whole batch
    forbidden = _FORBIDDEN[bitmask.view(torch.uint8).long()].reshape(len(picked), -1)[:, :vocab]  # [R, V]
    forbidden = forbidden.to(logits.device)
    if len(picked) == len(rows):
        logits.masked_fill_(forbidden, -math.inf)
    else:
        index = torch.tensor(picked, device=logits.device)
        logits[index] = logits[index].masked_fill(forbidden, -math.inf)
