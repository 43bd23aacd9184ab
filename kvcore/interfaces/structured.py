"""What a request's output must match (:class:`StructuredOutput`, a field of
:class:`~kvcore.interfaces.sampler.SamplingParams`); :mod:`kvcore.sampling.structured` enforces it."""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvcore.errors import GrammarError, InvalidRequestError

__all__ = ["StructuredOutput", "KINDS"]

#: the kinds of constraint and what their ``spec`` holds
KINDS = ("json", "json_object", "regex", "choice", "grammar")


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
