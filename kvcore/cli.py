"""The ``kvcore`` command line: generate, chat, backends, plugins, conformance, and commands from plugins."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any

from kvcore.errors import KVCoreError

__all__ = ["main"]


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1] (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="RNG seed for sampling")
    p.add_argument("--ignore-eos", action="store_true", default=None, help="do not stop at end-of-sequence")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when the text contains TEXT (not printed); repeat for several")
    p.add_argument("--min-p", type=float, default=None, help="drop tokens below min_p × the top probability (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="divide seen tokens' positive logits by it, multiply negative ones (1 = off)")
    p.add_argument("--presence-penalty", type=float, default=None, help="OpenAI presence penalty in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=None, help="OpenAI frequency penalty in [-2, 2]")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="with --json: each token's logprob and its K most likely alternatives (0-20)")


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="'smollm2' (default), a .gguf file or a Hugging Face directory")
    p.add_argument("--backend", default=None, help="attention backend for both phases (see `kvcore backends`)")
    p.add_argument("--prefill-backend", default=None, help="backend for prefill (overrides --backend)")
    p.add_argument("--decode-backend", default=None, help="backend for decode (overrides --backend)")
    p.add_argument("--kv-cache", default=None, help="KV cache (`kvcore plugins`; default: the backend's layout)")
    p.add_argument("--sampler", default=None, help="sampler (see `kvcore plugins`; default 'default')")
    p.add_argument("--dtype", default=None, help="float32 (default), bfloat16 or float16")
    p.add_argument("--device", default=None, help="torch device (default cpu)")
    p.add_argument("--weights", default=None, choices=["auto", "float", "int8", "int4"],
                   help="matmul weights: auto (default: int4 for a Q4 GGUF in bfloat16, else float), float, "
                        "int8 or int4 (weight-only quantized; need --dtype bfloat16 on CPU)")
    p.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="split the model over N processes (gloo on CPU, NCCL on CUDA; default 1)")
    p.add_argument("--config", default=None, metavar="FILE.toml", help="read settings from a TOML file")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcore", description="Plugin-style LLM inference core.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True)

    for name, help_text in (("generate", "complete raw text"), ("chat", "answer one chat message")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("prompt", help="the prompt text" if name == "generate" else "the user message")
        if name == "chat":
            p.add_argument("--system", default=None, help="system message (default: the template's)")
        _engine_args(p)
        _sampling_args(p)
        p.add_argument("--json", action="store_true", help="print a JSON result object as the last stdout line")
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    _engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or env KVCORE_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: --model)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests run at once (default 16)")
    p.add_argument("--max-queue-len", type=int, default=256, help="requests waiting beyond those; then 429")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit per request, in tokens")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="prompt tokens per prefill step")
    p.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (paged caches)")
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="size the paged KV cache to this budget")
    p.add_argument("--enable-prefix-caching", action="store_true", default=None, help="reuse shared prompt blocks")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.set_defaults(func=_run_serve)

    p = sub.add_parser("plugins", help="list registered backends, KV caches and samplers, with availability")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    p = sub.add_parser("backends", help="list registered backends and their capabilities")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--markdown", action="store_true", help="a Markdown table (the README's support matrix)")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    try:
        from kvcore.conformance.cli import add_parser as add_conformance
    except ImportError:
        add_conformance = None
    if add_conformance is not None:
        add_conformance(sub)
    # Commands from plugins (kvcore_register_commands), e.g. `kvcore bench` from kvcore-bench. A hook that
    # raises is skipped with one warning line, and what it added before raising is removed again.
    from kvcore.plugins import get_registry

    registry = get_registry()
    registry.backends  # noqa: B018 - the registry loads its plugins on first use
    for impl in registry.pm.hook.kvcore_register_commands.get_hookimpls():
        names, helps = dict(sub.choices), list(sub._choices_actions)
        try:
            impl.function(subparsers=sub)
        except Exception as exc:
            sub.choices.clear()
            sub.choices.update(names)
            sub._choices_actions[:] = helps
            print(f"kvcore: warning: plugin '{impl.plugin_name}' raised in kvcore_register_commands and was "
                  f"skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
    return parser


#: settings an environment variable may give (between flag and config file)
ENVIRONMENT = {"backend": "KVCORE_BACKEND", "model": "KVCORE_MODEL"}
#: defaults of the settings that have no default in EngineConfig / SamplingParams
DEFAULTS = {"model": "smollm2", "max_num_seqs": 1}


def resolve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Merge flag > environment (KVCORE_BACKEND, KVCORE_MODEL) > config file > defaults, for every key of the
    config file (``None`` where nothing is given: EngineConfig / SamplingParams then apply their defaults)."""
    from dataclasses import fields

    from kvcore.config import OPTION_TABLES, FileConfig, load_config

    file_cfg = load_config(args.config) if getattr(args, "config", None) else FileConfig()
    settings: dict[str, Any] = {}
    for f in fields(FileConfig):
        name = f.name
        value = getattr(args, name, None)
        if value is None and name in ENVIRONMENT:
            value = os.environ.get(ENVIRONMENT[name]) or None
        if value is None:
            value = getattr(file_cfg, name)
        settings[name] = DEFAULTS.get(name) if value is None else value
    for table, option in OPTION_TABLES.items():
        settings[option] = settings.pop(table)
    settings["plugin_options"] = settings.pop("plugins")
    return settings


def _run_generation(args: argparse.Namespace, chat: bool) -> int:
    from dataclasses import fields

    from kvcore.engine import Engine, EngineConfig
    from kvcore.errors import InvalidRequestError
    from kvcore.plugins import get_registry
    from kvcore.sampling import SamplingParams

    s = resolve_settings(args)
    if not args.prompt:
        raise InvalidRequestError("prompt is empty")
    sampling_keys = {f.name for f in fields(SamplingParams)}
    params = SamplingParams(**{k: v for k, v in s.items() if k in sampling_keys and v is not None})
    # Only a draw reads these; penalties and stop strings still apply to greedy decoding.
    defaults = SamplingParams()
    unused = [k for k in ("top_k", "top_p", "min_p", "seed") if getattr(params, k) != getattr(defaults, k)]
    if params.is_greedy and unused:
        names = ", ".join("--" + k.replace("_", "-") for k in unused)
        print(f"kvcore: warning: {names} have no effect at temperature 0 (greedy); set --temperature", file=sys.stderr)
    registry = get_registry()
    if s["plugin_options"]:
        registry.configure(s["plugin_options"])
    config = EngineConfig(**{f.name: s[f.name] for f in fields(EngineConfig) if s.get(f.name) is not None})
    # Validate the backend choice before the (slower) model load, so a typo fails fast.
    for name in {s["backend"], s["prefill_backend"], s["decode_backend"]} - {None}:
        registry.create(name, s["backend_options"].get(name))
    engine = Engine.from_pretrained(s["model"], config, registry=registry)
    tok = engine.tokenizer
    if chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        prompt_ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_bos=False)
    else:
        prompt_ids = tok.encode(args.prompt)

    out = sys.stdout
    rid = engine.add_request(prompt_ids, params)
    while engine.has_unfinished():
        for event in engine.step():
            if event.text:
                out.write(event.text)
                out.flush()
    out.write("\n")
    result = engine.release(rid)
    if result.error is not None:
        raise result.error
    if args.json:
        payload = {
            "prompt_token_ids": result.prompt_token_ids,
            "token_ids": result.token_ids,
            "text": result.text,
            "finish_reason": result.finish_reason.value,
            "backend": engine.prefill_backend.name,
            "prefill_backend": engine.prefill_backend.name,
            "decode_backend": engine.decode_backend.name,
            "kv_cache": engine.cache.name,
            "sampler": engine.sampler.name,
            "model": s["model"],
            "dtype": config.dtype,
            "weights": engine.model.weight_format,
            "metrics": result.metrics.as_dict(),
            "tensor_parallel_size": config.tensor_parallel_size,
        }
        if params.logprobs is not None:
            payload["logprobs"] = result.logprobs
            payload["top_logprobs"] = result.top_logprobs
        if engine.runner is not None:  # per rank: heads, pid, device, KV bytes per token and allocated
            payload["tensor_parallel"] = engine.runner.describe()
        out.write(json.dumps(payload) + "\n")
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from kvcore.config import load_config
    from kvcore.serving.server import DEFAULT_MAX_NUM_SEQS, build_engine, run_server

    s = resolve_settings(args)
    if args.max_num_seqs is None and (not args.config or load_config(args.config).max_num_seqs is None):
        s["max_num_seqs"] = DEFAULT_MAX_NUM_SEQS  # a server runs many requests; `generate` runs one
    engine = build_engine(s)
    return run_server(
        engine,
        model_name=args.served_model_name or s["model"],
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("KVCORE_API_KEY") or None,
        max_queue_len=args.max_queue_len,
        log_level=args.log_level,
    )


def _run_plugins(args: argparse.Namespace) -> int:
    from kvcore.plugins import get_registry
    from kvcore.support import format_table, plugin_rows

    rows = plugin_rows(get_registry())
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for kind, kind_rows in rows.items():
        print(f"{kind}:")
        print(format_table(kind_rows))
        print()
    return 0


def _run_backends(args: argparse.Namespace) -> int:
    from kvcore.plugins import get_registry
    from kvcore.support import backend_rows, format_table, markdown_table

    rows = backend_rows(get_registry())
    if args.json:
        print(json.dumps(rows, indent=2))
    elif args.markdown:
        print(markdown_table(rows))
    else:
        print(format_table(rows))
    return 0


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    text = str(message)
    print(text if text.startswith("kvcore:") else f"kvcore: warning: {text}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Known before parsing: building the parser loads plugins, whose load warnings are one line each.
    debug = "--debug" in argv or os.environ.get("KVCORE_DEBUG") == "1"
    if not debug:
        warnings.simplefilter("ignore", UserWarning)  # third-party library chatter
        warnings.showwarning = _one_line_warning
    args = build_parser().parse_args(argv)
    try:
        if args.command in ("generate", "chat"):
            return _run_generation(args, chat=args.command == "chat")
        if args.command == "backends":
            return _run_backends(args)
        if args.command == "plugins":
            return _run_plugins(args)
        return args.func(args)
    except KVCoreError as exc:
        if debug:
            raise
        print(f"kvcore: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("kvcore: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # a bug: still one line, with a hint to get the traceback
        if debug:
            raise
        print(
            f"kvcore: internal error: {type(exc).__name__}: {exc} (rerun with --debug for a traceback)",
            file=sys.stderr,
        )
        return 70


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
