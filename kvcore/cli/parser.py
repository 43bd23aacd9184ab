"""The ``kvcore`` argument parser: every built-in command's flags, and the commands plugins add. The flags of
run settings are derived from the fields that declare them (:mod:`kvcore.engine.fields`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvcore.engine.fields import SETTINGS
from kvcore.errors import did_you_mean
from kvcore.interfaces.setting import declared

__all__ = ["build_parser", "parse_args", "version_string"]


def version_string() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"kvcore {version('kvcore')}"
    except PackageNotFoundError:  # a source tree that is not installed
        return "kvcore (not installed)"


def _setting_flags(p: argparse.ArgumentParser, group: str, command: str) -> None:
    """A flag for each declared field of ``SETTINGS[group]`` that ``command`` takes (kvcore.interfaces.setting).
    Every one defaults to None, so the environment, the config file and the dataclass default apply."""
    for d in declared(SETTINGS[group]):
        if d.flag is None or d.setting.commands is not None and command not in d.setting.commands:
            continue
        how: dict[str, Any] = {"metavar": d.setting.metavar, "choices": d.setting.choices}
        if d.kind is bool:  # a setting that defaults to on needs a way to turn it off
            how = {"action": argparse.BooleanOptionalAction if d.default else "store_true"}
        elif d.kind is tuple:
            how["action"] = "append"  # repeat the flag for several
        elif d.kind in (int, float):
            how["type"] = d.kind
        p.add_argument(d.flag, dest=d.name, default=None, help=d.help.replace("%", "%%"),  # argparse formats help
                       **{k: v for k, v in how.items() if v is not None})


def _sampling_args(p: argparse.ArgumentParser, command: str) -> None:
    _setting_flags(p, "sampling", command)
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", default=None, metavar="FILE",
                       help="constrain the output to JSON valid against the schema in FILE (needs kvcore[structured])")
    shape.add_argument("--regex", default=None, help="constrain the output to match this regular expression")
    shape.add_argument("--grammar", default=None, metavar="FILE",
                       help="constrain the output to the grammar in FILE (GBNF or Lark)")


def _engine_args(p: argparse.ArgumentParser, command: str) -> None:
    _setting_flags(p, "run", command)
    _setting_flags(p, "engine", command)
    p.add_argument("--config", default=None, metavar="FILE.toml", help="read settings from a TOML file")
    p.add_argument("--no-model-cache", action="store_true",
                   help="neither read nor write the prepared-model cache (also: KVCORE_MODEL_CACHE=0)")
    p.add_argument("--verbose", action="store_true",
                   help="print on stderr the configuration kvcore chose for the settings left automatic, and why")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a port number") from None
    if not 0 <= port <= 65535:  # the socket layer would silently take it modulo 65536
        raise argparse.ArgumentTypeError(f"port {port} is outside 0-65535")
    return port


def _hidden_debug(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def build_parser(plugin_commands: bool = True) -> argparse.ArgumentParser:
    """Every command's parser; ``plugin_commands=False`` leaves out the commands plugins add, whose loading
    imports torch and every plugin (see :func:`parse_args`)."""
    parser = argparse.ArgumentParser(prog="kvcore", description="Plugin-style LLM inference core.")
    parser.add_argument("--version", action="version", version=version_string())
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete raw text")
    p.add_argument("prompt", nargs="?", default=None,
                   help="the prompt text; '-' reads it from standard input. Text piped in comes first, then this")
    p.add_argument("--prompt-file", default=None, metavar="PATH", help="read the prompt from a file (UTF-8)")
    _generation_args(p, "generate")

    p = sub.add_parser("chat", help="chat with the model: one message, or a conversation (REPL)")
    p.add_argument("prompt", nargs="?", default=None,
                   help="the user message ('-': read it from standard input); without it, a conversation")
    p.add_argument("--prompt-file", default=None, metavar="PATH", help="read the user message from a file")
    p.add_argument("-i", "--interactive", action="store_true",
                   help="a multi-turn conversation (the default when no message is given); /reset, /exit")
    p.add_argument("--system", default=None, help="system message (default: the template's)")
    _generation_args(p, "chat")

    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    _engine_args(p, "serve")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000; 0 = any free port)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or env KVCORE_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: --model)")
    p.add_argument("--max-queue-len", type=int, default=256, help="requests waiting beyond those; then 429")
    p.add_argument("--step-watchdog-s", type=float, default=None,
                   help="/health fails (503) while one engine step runs longer (default 60; 0: off)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--strict", action="store_true",
                   help="answer requests with unknown fields 400 (default: ignore them, log and name them)")
    _hidden_debug(p)

    p = sub.add_parser("plugins", help="list registered backends, KV caches, samplers, proposers and attention "
                                       "variants, with availability")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _hidden_debug(p)

    p = sub.add_parser("backends", help="list registered backends and their capabilities")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--markdown", action="store_true", help="a Markdown table (the README's support matrix)")
    _hidden_debug(p)

    p = sub.add_parser("models", help="list supported model architectures and the backends that serve them")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--markdown", action="store_true", help="a Markdown table (the README's)")
    _hidden_debug(p)

    p = sub.add_parser("kernels", help="kvcore's C++ CPU kernels: whether they can run here; build them ahead")
    p.add_argument("action", nargs="?", choices=["status", "build"], default="status",
                   help="status (default): report; build: build now (otherwise the first use builds them)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _hidden_debug(p)

    try:
        from kvcore.conformance.cli import add_parser as add_conformance
    except ImportError:
        add_conformance = None
    if add_conformance is not None:
        add_conformance(sub)
    if plugin_commands:
        _plugin_commands(sub)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed as :func:`main` runs it. A built-in command, ``--version`` and their errors are parsed
    without loading plugins, so they answer before torch is imported; a bare ``kvcore``, ``kvcore --help`` and
    any other command load the third-party plugins, whose commands belong in the list. An unknown flag is an
    error naming the closest flags of its command."""
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(plugin_commands=False)
    builtin = command in _commands(parser).choices
    light = builtin or (command is None and "--version" in argv and not {"-h", "--help"} & set(argv))
    if not light:
        _plugin_commands(_commands(parser))
    args, unknown = parser.parse_known_args(argv)
    flags = [a for a in unknown if a.startswith("-") and a != "-"]
    if flags:
        sub = _commands(parser).choices.get(args.command, parser)
        options = [o for action in sub._actions for o in action.option_strings if o.startswith("--")]
        given = flags[0].split("=", 1)[0]
        sub.error(f"unknown flag {given}{did_you_mean(given.replace('_', '-'), options)}")
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def _commands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _generation_args(p: argparse.ArgumentParser, command: str) -> None:
    _engine_args(p, command)
    _sampling_args(p, command)
    p.add_argument("--json", action="store_true", help="print a JSON result object as the last stdout line")
    _hidden_debug(p)


def _plugin_commands(sub) -> None:
    """Commands from plugins (kvcore_register_commands), e.g. `kvcore bench` from kvcore-bench: only the plugins
    are imported, not kvcore's built-ins (nor torch, unless a plugin imports it). A hook that raises is skipped
    with one warning line, and what it added before raising is removed again."""
    from kvcore.plugins.entry_points import command_plugins

    for impl in command_plugins().hook.kvcore_register_commands.get_hookimpls():
        names, helps = dict(sub.choices), list(sub._choices_actions)
        try:
            impl.function(subparsers=sub)
        except Exception as exc:
            sub.choices.clear()
            sub.choices.update(names)
            sub._choices_actions[:] = helps
            print(f"kvcore: warning: plugin '{impl.plugin_name}' raised in kvcore_register_commands and was "
                  f"skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
