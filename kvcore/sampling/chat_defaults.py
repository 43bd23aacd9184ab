"""The sampling settings of a chat request that leaves them unset: ``kvcore chat`` and ``/v1/chat/completions``.

Why not greedy: a small instruction model decoded greedily repeats itself. SmolLM2-135M-Instruct (kvcore's
default model), greedy, answers "What is the capital of France?" with "L'Étoile de la Cité, la Ville de la
République, la République, la République, ..." until the token limit. Chat front-ends sample instead, with a
repetition guard: Ollama at temperature 0.8, top_k 40, top_p 0.9 and repeat_penalty 1.1 over the last 64 tokens;
llama.cpp at temperature 0.8, top_k 40, top_p 0.95, min_p 0.05. :data:`CHAT_DEFAULTS` are Ollama's.

A model's files may recommend their own settings (:attr:`Tokenizer.recommended_sampling
<kvcore.text.tokenizer.Tokenizer.recommended_sampling>`: a GGUF's ``general.sampling.*`` keys, a Hugging Face
directory's ``generation_config.json``); each one they give replaces kvcore's, and the rest stay (as in Ollama,
whose defaults fill what a model's parameters leave out).

The rules (:meth:`ChatDefaults.fill`): a setting the request gives wins; a request that asks for temperature 0
is plain greedy decoding, none of these applied; without a seed a sampled reply is random, with one it is the
same every time. ``kvcore generate``, ``/v1/completions``, the Python API and the conformance suite never use
these: they stay greedy (``/v1/completions``: OpenAI's defaults) and exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ChatDefaults", "CHAT_DEFAULTS", "OPENAI_DEFAULTS", "chat_defaults"]

#: what the server gives a request's unset sampling fields outside chat (``/v1/completions``): OpenAI's
#: temperature 1 and top_p 1, no other filter, no penalty
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                   "repetition_window": None}


@dataclass(frozen=True)
class ChatDefaults:
    """Sampling settings (:class:`~kvcore.interfaces.sampler.SamplingParams` fields) chat uses where a request
    gives none. ``source``: where they come from, for ``--verbose`` and the docs."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.9
    min_p: float = 0.0
    repetition_penalty: float = 1.1
    repetition_window: int | None = 64  # the last 64 tokens of prompt + reply, as Ollama's repeat_last_n
    source: str = "kvcore's chat defaults, Ollama's"

    def settings(self) -> dict[str, Any]:
        """The sampling settings, by SamplingParams field name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "source"}

    def with_model(self, recommended: Mapping[str, Any] | None, model: str = "the model") -> ChatDefaults:
        """These defaults with each setting the model recommends in its place."""
        known = {k: v for k, v in (recommended or {}).items() if k in self.settings()}
        if not known:
            return self
        return dataclasses.replace(self, **known, source=f"{model}'s recommended {', '.join(sorted(known))}; "
                                                         f"the rest {self.source}")

    def fill(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """``given`` (SamplingParams fields, None = not given) with each setting it leaves unset taken from
        these defaults; unchanged when it asks for temperature 0 (greedy, exactly as ``kvcore generate``)."""
        from kvcore.interfaces.sampler import SamplingParams

        temperature = given.get("temperature")
        if isinstance(temperature, (int, float)) and temperature < SamplingParams.GREEDY_BELOW:
            return dict(given)
        return {**given, **{k: v for k, v in self.settings().items() if given.get(k) is None}}

    def unset_fields(self, temperature: object) -> dict[str, Any]:
        """What a chat completion request with ``temperature`` (None: not given) gets for each sampling field it
        leaves unset: these defaults, or :data:`OPENAI_DEFAULTS` (nothing added) when it asks for greedy."""
        return {**OPENAI_DEFAULTS, **self.fill({"temperature": temperature})}


#: kvcore's chat defaults: the one place they are set (docs/cli.md and docs/serving.md explain them)
CHAT_DEFAULTS = ChatDefaults()


def chat_defaults(tokenizer: Any, model: str = "the model") -> ChatDefaults:
    """:data:`CHAT_DEFAULTS` with what ``tokenizer``'s model recommends (``recommended_sampling``) in place."""
    return CHAT_DEFAULTS.with_model(getattr(tokenizer, "recommended_sampling", None), model)
