"""Structured output: constrain generation to a JSON schema, any JSON object, a regex, one of several strings,
or a grammar (Lark or llama.cpp's GBNF), with llguidance (the optional extra ``kvcore[structured]``).

:class:`StructuredOutput` says what the output must match (a field of :class:`~kvcore.sampling.SamplingParams`).
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvcore.errors import GrammarError, InvalidRequestError

if TYPE_CHECKING:
    import llguidance

__all__ = ["StructuredOutput", "GrammarCompiler", "apply_grammar_masks", "STRUCTURED_INSTALL"]

STRUCTURED_INSTALL = "pip install 'kvcore[structured]'"
#: the kinds of constraint and what their ``spec`` holds
KINDS = ("json", "json_object", "regex", "choice", "grammar")
#: JSON is written compactly (no free whitespace): a model cannot wander off into spaces and newlines
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """What the generated text must match; give exactly one of the fields (vLLM's ``StructuredOutputsParams``).

    :param json: a JSON schema (a dict or its JSON text); the output is one JSON value valid against it.
    :param json_object: any JSON object (OpenAI's ``response_format={"type": "json_object"}``).
    :param regex: a regular expression (Rust ``regex`` syntax) the whole output matches.
    :param choice: the output is exactly one of these strings.
    :param grammar: a Lark grammar (llguidance's dialect) or a GBNF grammar (llama.cpp's ``root ::= ...``).
    """

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured output takes exactly one of json, json_object, regex, choice, grammar; got "
                f"{', '.join(given) or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"structured output: {name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not all(isinstance(c, str) and c for c in choice) or not choice:
                raise InvalidRequestError(
                    f"structured output: choice must be a non-empty list of non-empty strings, got {choice!r}")
            object.__setattr__(self, "choice", tuple(choice))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def grammar_text(self) -> str:
        """The llguidance grammar this constraint compiles to (the compile cache's key)."""
        ll = _llguidance()
        matcher = ll.LLMatcher
        if self.json is not None:
            return matcher.grammar_from_json_schema(self.json, defaults=JSON_OPTIONS)
        if self.json_object:
            return matcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if self.regex is not None:
            return matcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(self.grammar)
        except Exception as exc:  # the converter raises its own exception types for a malformed GBNF
            raise GrammarError(f"grammar: not valid GBNF or Lark: {exc}") from None
        return matcher.grammar_from_lark(lark)


def _schema_text(schema: str | dict) -> str:
    """A JSON schema as JSON text, checked to be a JSON object (key order kept: it orders the output)."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"json schema: not valid JSON: {exc}") from None
    else:
        parsed = schema
    if not isinstance(parsed, dict):
        raise GrammarError(f"json schema: must be a JSON object, got {type(parsed).__name__}")
    try:
        return schema if isinstance(schema, str) else json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"json schema: not JSON-serialisable: {exc}") from None


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

    :param tokenizer: a :class:`~kvcore.tokenizer.Tokenizer` (its ``tokenizers`` backend is what llguidance
        reads); :param vocab_size: the width of the model's logits; :param eos_token_ids: the tokens that end
        a constrained output once it is complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], max_cached: int = 128) -> None:
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
        grammar = structured.grammar_text()
        compiled = self._cache.get(grammar)
        if compiled is None:
            ll = _llguidance()
            compiled = ll.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
            if compiled.is_error():
                raise GrammarError(f"{_what(structured)}: {_one_line(compiled.get_error())}")
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
