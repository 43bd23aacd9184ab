"""``kvcore generate`` and one-shot ``kvcore chat``: build the engine, stream one request, print its JSON.

The pieces (:func:`load_engine`, :func:`stream_reply`, :func:`result_payload`) are shared with the
interactive chat (:mod:`kvcore.cli.chat`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from kvcore.cli.settings import read_bounded_text, read_prompt, resolve_settings, with_piped_stdin
from kvcore.engine.threads import apply_threads
from kvcore.errors import InvalidRequestError, OutputError

__all__ = ["RunState", "Loaded", "chat_params", "load_engine", "peak_rss_bytes", "sampling_params", "stream_reply",
           "result_payload", "run_generate", "write_out"]


@dataclass
class RunState:
    """What the top level prints when a run is interrupted: with ``--json``, ``partial()`` is the result object
    of the request in flight (what it generated so far), or ``None`` before one started."""

    json: bool = False
    partial: Callable[[], dict[str, Any]] | None = None
    #: set when the run holds a tensor-parallel group: the engine's close (the other ranks stop), after which the
    #: CLI ends with ``os._exit`` once its output is flushed, since tearing the group's collective backends down
    #: at interpreter exit can abort the process (SIGABRT)
    end_process: Callable[[], None] | None = None


@dataclass
class Loaded:
    engine: Any
    config: Any
    settings: dict[str, Any]
    params: Any
    extra: dict[str, Any] = field(default_factory=dict)


def sampling_params(s: dict[str, Any]):
    """The request's SamplingParams from the resolved settings."""
    from dataclasses import fields

    from kvcore.interfaces.sampler import SamplingParams

    keys = {f.name for f in fields(SamplingParams)}
    return SamplingParams(**{k: v for k, v in s.items() if k in keys and v is not None})


def warn_unused_sampling(params, flags: Collection[str]) -> None:
    """One stderr line naming the sampling options among ``flags`` (given on the command line) that have no
    effect because ``params`` (chat's defaults filled in) decode greedily."""
    from kvcore.interfaces.sampler import SamplingParams

    # Only a draw reads these; penalties and stop strings still apply to greedy decoding.
    defaults = SamplingParams()
    # A config file's values are standing defaults for every run (a shipped one sets seed = 0), not this
    # run's intent: only a flag given now is worth a warning.
    unused = [k for k in ("top_k", "top_p", "min_p", "seed")
              if k in flags and getattr(params, k) != getattr(defaults, k)]
    if params.is_greedy and unused:
        names = ", ".join("--" + k.replace("_", "-") for k in unused)
        verb = "has" if len(unused) == 1 else "have"
        print(f"kvcore: warning: {names} {verb} no effect at temperature 0 (greedy); set --temperature",
              file=sys.stderr)


def chat_params(params, s: dict[str, Any], tokenizer, verbose: bool = False):
    """``params`` with each sampling setting the flags and config file leave unset taken from the chat defaults
    (the model's recommended settings, else kvcore's: :mod:`kvcore.sampling.chat_defaults`); ``--temperature
    0`` keeps plain greedy decoding."""
    from kvcore.sampling.chat_defaults import chat_defaults

    defaults = chat_defaults(tokenizer, s["model"])
    given = {k: s.get(k) for k in defaults.settings()}
    filled = {k: v for k, v in defaults.fill(given).items() if given[k] is None and v is not None}
    if verbose and filled:
        shown = ", ".join(f"{k} {v}" for k, v in filled.items())
        print(f"kvcore: chat sampling: {shown} ({defaults.source}; flags override them)", file=sys.stderr)
    return dataclasses.replace(params, **filled)


def structured_output(args: argparse.Namespace):
    """The StructuredOutput of ``--json-schema FILE``, ``--regex`` or ``--grammar FILE``, or None."""
    from kvcore.interfaces.structured import StructuredOutput

    if getattr(args, "regex", None) is not None:
        return StructuredOutput(regex=args.regex)
    for flag, key in (("json_schema", "json"), ("grammar", "grammar")):
        path = getattr(args, flag, None)
        if path is not None:
            what = f"--{flag.replace('_', '-')} file"
            return StructuredOutput(**{key: read_bounded_text(path, what, MAX_SPEC_BYTES)})
    return None


#: the largest --json-schema / --grammar file read (bytes): far above any real schema or grammar
MAX_SPEC_BYTES = 1 << 20


def load_engine(args: argparse.Namespace, request_ids: Callable[[Any], list[int]] | None = None,
                chat: bool = False) -> Loaded:
    """Settings, threads, sampling parameters (checked first: a typo fails before the model loads), the
    backend choice (likewise), then the model and the engine. ``request_ids``: the one request's prompt ids
    given the tokenizer, for an engine whose KV cache is sized to that request (one-shot generate / chat).
    ``chat``: the sampling settings left unset are chat's defaults (:mod:`kvcore.sampling.chat_defaults`)."""
    from dataclasses import fields

    s = resolve_settings(args)  # before torch loads: a config file's error answers at once

    from kvcore.engine.config import check_option_tables
    from kvcore.engine.core import Engine, EngineConfig
    from kvcore.plugins.registry import get_registry

    threads = apply_threads(s.get("threads"))
    before_load = peak_rss_bytes()  # python, torch and kvcore imported: what the model adds comes on top
    params = sampling_params(s)
    structured = structured_output(args)
    if structured is not None:
        params = dataclasses.replace(params, structured_output=structured)
    registry = get_registry()
    if s["plugin_options"]:
        registry.configure(s["plugin_options"])
    config = EngineConfig(**{f.name: s[f.name] for f in fields(EngineConfig) if s.get(f.name) is not None})
    check_option_tables(registry, config)  # as the engine does, but before the model loads
    for name in {s["backend"], s["prefill_backend"], s["decode_backend"]} - {None}:
        registry.create(name, s["backend_options"].get(name))
    needed = None if request_ids is None else (lambda tok: len(request_ids(tok)) + params.max_new_tokens)
    engine = Engine.from_pretrained(s["model"], config, registry=registry, request_tokens=needed,
                                    model_cache=False if getattr(args, "no_model_cache", False) else None)
    if structured is not None and engine.grammars is not None:
        engine.grammars.matcher(structured)  # a malformed schema or grammar fails here, before any prompt
    if chat:
        params = chat_params(params, s, engine.tokenizer, getattr(args, "verbose", False))
    warn_unused_sampling(params, {k for k in vars(args) if getattr(args, k) is not None})
    if getattr(args, "verbose", False):
        print(f"kvcore: {engine.choice.describe()}", file=sys.stderr)
    return Loaded(engine, engine.config, s, params, {"threads": threads, "rss_before_load_bytes": before_load})


def stream_reply(loaded: Loaded, prompt_ids: list[int], state: RunState, out=None):
    """Run one request, streaming its text to ``out``; returns its GenerationResult (its error raised). While it
    runs, ``state.partial`` gives its result object so far."""
    engine = loaded.engine
    out = out or sys.stdout
    rid = engine.add_request(prompt_ids, loaded.params)
    state.partial = lambda: result_payload(loaded, engine.result(rid), finish_reason="interrupted")
    try:
        while engine.has_unfinished():
            for event in engine.step():
                if event.text and event.request_id == rid:
                    write_out(event.text, out)
        write_out("\n", out)
    except BaseException:
        state.partial = _frozen(state.partial)  # the engine forgets the request below; keep what it made
        engine.abort(rid)
        engine.release(rid)
        raise
    state.partial = None
    result = engine.release(rid)
    if result.error is not None:
        raise result.error
    return result


def write_out(text: str, out=None) -> None:
    """Write and flush ``text`` to standard output; a failed write (full disk, I/O error) is an OutputError. A
    closed pipe (BrokenPipeError) propagates: the top level then exits quietly."""
    out = out or sys.stdout
    try:
        out.write(text)
        out.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise OutputError(f"cannot write to standard output: {exc.strerror or exc}") from None


def _frozen(partial):
    payload = partial() if partial is not None else None
    return (lambda: payload) if payload is not None else None


def result_payload(loaded: Loaded, result, finish_reason: str | None = None) -> dict[str, Any]:
    """The ``--json`` object of one request."""
    engine, config, s, params = loaded.engine, loaded.config, loaded.settings, loaded.params
    payload = {
        "prompt_token_ids": result.prompt_token_ids,
        "token_ids": result.token_ids,
        "text": result.text,
        "finish_reason": finish_reason or result.finish_reason.value,
        "backend": engine.prefill_backend.name,
        "prefill_backend": engine.prefill_backend.name,
        "decode_backend": engine.decode_backend.name,
        "kv_cache": engine.cache.name,
        "sampler": engine.sampler.name,
        "model": s["model"],
        "dtype": config.dtype,
        "weights": engine.model.weight_format,
        "lm_head": config.lm_head,
        "compile": config.compile,
        "metrics": result.metrics.as_dict(),
        "tensor_parallel_size": config.tensor_parallel_size,
        "threads": loaded.extra.get("threads"),
        "choice": engine.choice.as_dict(),
        "memory": {"peak_rss_bytes": peak_rss_bytes(), "rss_before_load_bytes": loaded.extra["rss_before_load_bytes"]},
    }
    if params.logprobs is not None:
        payload["logprobs"] = result.logprobs
        payload["top_logprobs"] = result.top_logprobs
    ranks = engine.runner.describe()  # per rank: heads, pid, device, KV bytes per token and allocated
    if ranks is not None:
        payload["tensor_parallel"] = ranks
    return payload


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size so far (None where the OS does not report it). Linux: ``VmHWM``,
    the peak of this program's own memory map; ``getrusage`` would carry a forking parent's peak over into a
    child started with fork + exec."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def chat_prompt_ids(tok, messages: list[dict[str, str]]) -> list[int]:
    """The model's chat template (tokenizer ``tok``) applied to ``messages``, with the assistant's turn opened, as
    token ids."""
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_bos=False)


def run_generate(args: argparse.Namespace, state: RunState, chat: bool = False, prompt: str | None = None) -> int:
    """``kvcore generate`` (raw text) or a one-shot ``kvcore chat`` (the message in the chat template);
    ``prompt`` when the caller has read it already."""
    prompt = prompt if prompt is not None else read_prompt(args)
    if not chat and args.prompt != "-":
        prompt = with_piped_stdin(prompt)
    if not prompt:
        raise InvalidRequestError("prompt is empty" if prompt is not None else
                                  "no prompt: give it as an argument, '-' for standard input, or --prompt-file")
    messages = [{"role": "system", "content": args.system}] if chat and args.system else []

    def request_ids(tokenizer) -> list[int]:
        if chat:
            return chat_prompt_ids(tokenizer, [*messages, {"role": "user", "content": prompt}])
        return tokenizer.encode(prompt)

    loaded = load_engine(args, request_ids, chat=chat)
    state.end_process = loaded.engine.close if loaded.config.tensor_parallel_size > 1 else None
    result = stream_reply(loaded, request_ids(loaded.engine.tokenizer), state)
    if args.json:
        write_out(json.dumps(result_payload(loaded, result)) + "\n")
    return 0
