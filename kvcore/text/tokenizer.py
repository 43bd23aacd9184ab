"""Text <-> token ids, chat templates and streaming detokenisation.

:class:`Tokenizer` wraps a Hugging Face ``tokenizers.Tokenizer`` (the fast Rust one) and adds what a
generation loop needs on top: the model's BOS/EOS conventions, its Jinja chat template, and a
:class:`StreamDecoder` that turns one token id at a time into text without ever emitting half a UTF-8
character. It is built either from a ``tokenizer.json`` (:meth:`Tokenizer.from_file`, Hugging Face
directories) or around a backend built from a GGUF vocabulary (:mod:`kvcore.text.vocab`: byte-level BPE
or SentencePiece).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import tokenizers

from kvcore.errors import ConfigError, InvalidRequestError, ModelLoadError
from kvcore.text.stream_decoder import StreamDecoder

if TYPE_CHECKING:  # jinja2 is imported on the first chat template use: a plain `generate` never needs it
    import jinja2

__all__ = ["Tokenizer", "StreamDecoder"]

#: special tokens chat templates use to close a turn; a generation loop must stop on them even when the
#: model's EOS is a different token (e.g. Llama 3's ``<|eot_id|>`` vs ``<|end_of_text|>``)
_END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_turn|>",
)

def _token_content(value: object) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A model's tokenizer: encode/decode, chat template, BOS/EOS ids, streaming decode.

    Args:
        backend: the ``tokenizers.Tokenizer`` doing the work; its post-processor is bypassed (BOS is
            added here, per ``add_bos``) and special-token strings in the text map to their ids.
        bos_token_id: beginning-of-sequence id, or None when the model has none.
        eos_token_ids: ids that end generation; the chat template's end-of-turn token is added to them.
        pad_token_id: padding id, or None.
        add_bos: whether :meth:`encode` prepends BOS by default.
        chat_template: the model's Jinja chat template, or None.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        recommended_sampling: Mapping[str, Any] | None = None,
    ) -> None:
        self._backend = backend
        #: the sampling settings the model's files recommend for chat, as SamplingParams fields (empty when they
        #: give none; kvcore.loaders.recommended): like the chat template, what a chat front-end reads from a model
        self.recommended_sampling = dict(recommended_sampling or {})
        self._bos_token_id = bos_token_id
        self._pad_token_id = pad_token_id
        self._add_bos = bool(add_bos)
        self._chat_template = chat_template or None
        self._compiled_template: jinja2.Template | None = None
        self._special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self._max_token_chars: int | None = None
        eos = list(dict.fromkeys(int(i) for i in eos_token_ids))
        eos.extend(i for i in self._end_of_turn_ids() if i not in eos)
        self._eos_token_ids = eos

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        *,
        tokenizer_config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        eos_token_ids: Sequence[int] = (),
        recommended_sampling: Mapping[str, Any] | None = None,
    ) -> Tokenizer:
        """Load a ``tokenizer.json``.

        Args:
            path: the ``tokenizer.json`` file.
            tokenizer_config: the parsed ``tokenizer_config.json`` (bos/eos/pad tokens, ``add_bos_token``,
                ``chat_template``), or None.
            chat_template: a template that overrides the config's (e.g. from ``chat_template.jinja``).
            eos_token_ids: extra EOS ids, e.g. from ``generation_config.json``; the config's
                ``eos_token`` is added to them.
            recommended_sampling: the model's recommended sampling settings (:attr:`recommended_sampling`).
        """
        try:
            backend = tokenizers.Tokenizer.from_file(os.fspath(path))
        except Exception as exc:  # the Rust side raises a bare Exception for bad JSON
            raise ModelLoadError(f"cannot read tokenizer {os.fspath(path)!r}: {exc}") from None
        cfg = dict(tokenizer_config or {})

        def token_id(key: str) -> int | None:
            content = _token_content(cfg.get(key))
            return None if content is None else backend.token_to_id(content)

        bos = token_id("bos_token")
        eos = list(eos_token_ids)
        if (cfg_eos := token_id("eos_token")) is not None:
            eos.append(cfg_eos)
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:
            # no flag: see whether tokenizer.json's own post-processor (e.g. Llama 3's) adds BOS
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and bool(probe) and probe[0] == bos
        template = chat_template if chat_template is not None else cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=eos,
            pad_token_id=token_id("pad_token"),
            add_bos=bool(add_bos),
            chat_template=template if isinstance(template, str) else None,
            recommended_sampling=recommended_sampling,
        )

    # ------------------------------------------------------------------ properties

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_chars(self) -> int:
        """Characters of the longest token as the vocabulary spells it (added tokens included): no token
        covers more characters of un-normalised text than this (byte-level BPE spells one byte per
        character, SentencePiece spells a space as one character and byte fallbacks as six)."""
        if self._max_token_chars is None:
            vocab = self._backend.get_vocab(with_added_tokens=True)
            self._max_token_chars = max((len(t) for t in vocab), default=1)
        return self._max_token_chars

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end generation: the model's EOS plus the chat template's end-of-turn token."""
        return list(self._eos_token_ids)

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_token_id

    @property
    def add_bos(self) -> bool:
        """Whether :meth:`encode` prepends BOS when not told otherwise."""
        return self._add_bos

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; special-token strings in it (``<|im_start|>``) map to their ids.

        Args:
            add_bos: prepend BOS; None uses the model's default. BOS is not doubled when the text
                already starts with it (e.g. a chat template that writes it).
        """
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a str, got {type(text).__name__}")
        try:
            # encode_batch lets go of the GIL while it works (encode does not): a server tokenising in a
            # worker thread keeps answering on its event loop
            ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        except TypeError:  # the Rust side rejects strings UTF-8 cannot encode
            raise InvalidRequestError(
                "text contains a lone surrogate (invalid Unicode): fix the input"
            ) from None
        if add_bos is None:
            add_bos = self._add_bos
        bos = self._bos_token_id
        if add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A fresh :class:`StreamDecoder` for one generated sequence."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat template

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the model's chat template.
        ``tools``: OpenAI-style tool definitions, handed to the template as ``tools`` (only a template that
        :attr:`supports_tools` renders them).

        Returns the prompt text; encode it with :meth:`encode` (special tokens in it are recognised).
        Raises ConfigError when the model has no template, InvalidRequestError when the messages are
        malformed or the template rejects them.
        """
        if self._chat_template is None:
            raise ConfigError("this model has no chat template: pass a raw prompt instead of chat messages")
        if not isinstance(messages, list) or not all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages
        ):
            raise InvalidRequestError("chat messages must be a list of {'role': str, 'content': str} dicts")
        import jinja2

        from kvcore.text.chat_template import TemplateRaised, render_template

        template = self._template()
        bos = self._bos_token_id
        eos = self._eos_token_ids[0] if self._eos_token_ids else None
        try:
            return render_template(
                template,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.id_to_token(bos) if bos is not None else "",
                eos_token=self.id_to_token(eos) if eos is not None else "",
                **({"tools": tools} if tools else {}),
            )
        except TemplateRaised as exc:
            raise InvalidRequestError(f"chat template rejected the messages: {exc}") from None
        except jinja2.TemplateError as exc:
            raise ConfigError(f"chat template failed to render: {exc}") from None

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tool definitions (it reads a ``tools`` variable)."""
        if not self._chat_template:
            return False
        import jinja2.meta

        try:
            ast = jinja2.Environment().parse(self._chat_template)
        except jinja2.TemplateSyntaxError:
            return False  # rendering reports the broken template
        return "tools" in jinja2.meta.find_undeclared_variables(ast)

    def _template(self) -> jinja2.Template:
        if self._compiled_template is None:
            from kvcore.text.chat_template import compile_template

            self._compiled_template = compile_template(self._chat_template or "")
        return self._compiled_template

    def _end_of_turn_ids(self) -> list[int]:
        """Special tokens the chat template uses to close a turn."""
        if not self._chat_template:
            return []
        ids = []
        for token in _END_OF_TURN_TOKENS:
            token_id = self._backend.token_to_id(token)
            if token in self._chat_template and token_id is not None and token_id in self._special_ids:
                ids.append(token_id)
        return ids

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self._bos_token_id}, "
            f"eos_token_ids={self._eos_token_ids}, add_bos={self._add_bos})"
        )
