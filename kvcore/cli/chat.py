"""``kvcore chat``: one message, or a conversation.

Without a message (or with ``-i``) it is a REPL: each line read is a user turn; the whole conversation so
far goes through the model's chat template every turn, so the model sees the history. ``/reset`` forgets
it (the system message stays), ``/help`` lists the commands, ``/exit`` (or end of input, Ctrl-D) ends the
session. On a terminal each turn is read with a ``>>>`` prompt with line editing and a history kept across
sessions (readline; the file ``$XDG_STATE_HOME/kvcore/chat_history``, ``~/.local/state`` by default); a
line ending in a backslash continues on the next, and a turn opened with three double quotes runs until a
line ending in three double quotes (as in Ollama). Ctrl-C stops the reply being written (the turn is dropped)
or, at the prompt, clears the line (the conversation stays); from a pipe, each line is a turn and Ctrl-C ends
the session.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kvcore.cli.generate import (
    RunState,
    chat_prompt_ids,
    load_engine,
    result_payload,
    run_generate,
    stream_reply,
    write_out,
)
from kvcore.cli.settings import read_bounded_stdin, read_prompt
from kvcore.errors import InvalidRequestError

__all__ = ["run_chat"]

COMMANDS = "/reset clears the conversation, /exit (or Ctrl-D) ends it, /help for more"
HELP = """commands:
  /reset     forget the conversation (the system message stays)
  /exit      end the session (also /quit, or Ctrl-D at an empty prompt)
  /help      this text
input: a line ending in \\ continues on the next line; \"\"\" opens a multi-line message, \"\"\" closes it.
Ctrl-C stops a reply, or clears the line being typed. Up/Down recall earlier messages."""
#: lines of history kept in the history file
HISTORY_LENGTH = 1000


def run_chat(args: argparse.Namespace, state: RunState, stdin=None) -> int:
    stdin = stdin or sys.stdin
    first = read_prompt(args, stdin)
    if first is not None and not args.interactive:
        return run_generate(args, state, chat=True, prompt=first)
    if stdin is None:
        raise InvalidRequestError("no message: give it as an argument, or chat on standard input (closed here)")
    tty = stdin.isatty()
    loaded = load_engine(args, chat=True)
    state.end_process = loaded.engine.close if loaded.config.tensor_parallel_size > 1 else None
    history = _start_history() if tty and stdin is sys.stdin else None
    system = [{"role": "system", "content": args.system}] if args.system else []
    if tty:
        print(f"kvcore chat with {loaded.settings['model']}: {COMMANDS}.", file=sys.stderr)
    try:
        return _converse(args, state, loaded, stdin, tty, first, system)
    finally:
        if history is not None:
            _save_history(history)


def _converse(args, state: RunState, loaded, stdin, tty: bool, first: str | None, system: list[dict]) -> int:
    messages = list(system)
    while True:
        line = first if first is not None else _read_turn(stdin, tty)
        first = None
        if line is None or line.strip() in ("/exit", "/quit"):
            return 0
        line = line.strip()
        if not line:
            continue
        if line == "/help":
            print(HELP, file=sys.stderr)
            continue
        if line == "/reset":
            messages = list(system)
            print("kvcore: conversation cleared", file=sys.stderr)
            continue
        if line.startswith("/") and " " not in line:
            print(f"kvcore: unknown command '{line}': {COMMANDS}", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        try:
            result = stream_reply(loaded, chat_prompt_ids(loaded.engine.tokenizer, messages), state)
        except KeyboardInterrupt:
            if not tty:
                raise
            messages.pop()
            print("\nkvcore: reply stopped", file=sys.stderr)
            continue
        except InvalidRequestError as exc:  # e.g. the conversation outgrew the context: /reset and go on
            if not tty:
                raise
            messages.pop()
            print(f"kvcore: error: {exc} (/reset starts over)", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": result.text})
        if args.json:
            write_out(json.dumps(result_payload(loaded, result)) + "\n")


def _read_turn(stdin, tty: bool) -> str | None:
    """The next user turn (continuation lines joined), or None at end of input."""
    if not (tty and stdin is sys.stdin):
        line = read_bounded_stdin(stdin, line=True)
        return line if line else None
    while True:
        try:
            return _read_lines()
        except KeyboardInterrupt:  # Ctrl-C at the prompt: drop what was typed, keep the conversation
            print("^C", file=sys.stderr)
        except EOFError:
            print(file=sys.stderr)
            return None


def _read_lines() -> str:
    """One turn from the terminal: a line, lines joined by a trailing backslash, or a \"\"\" block."""
    line = input(">>> ")
    if line.lstrip().startswith('"""'):
        parts = [line.lstrip()[3:]]
        while not parts[-1].rstrip().endswith('"""') or (len(parts) == 1 and parts[0].strip() == ""):
            parts.append(input("... "))
        parts[-1] = parts[-1].rstrip()[:-3]
        return "\n".join(parts).strip("\n")
    parts = [line]
    while parts[-1].endswith("\\"):
        parts[-1] = parts[-1][:-1]
        parts.append(input("... "))
    return "\n".join(parts)


def history_path() -> Path:
    """Where ``kvcore chat`` keeps its input history: under ``$XDG_STATE_HOME`` (``~/.local/state``)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "kvcore" / "chat_history"


def _start_history():
    """Turn on readline editing and load the history; the readline module, or None where there is none."""
    try:
        import readline
    except ImportError:  # a Python built without it: plain input() still works
        return None
    readline.set_history_length(HISTORY_LENGTH)
    try:
        readline.read_history_file(history_path())
    except (FileNotFoundError, OSError):
        pass  # the first session, or an unreadable file: start empty
    return readline


def _save_history(readline) -> None:
    path = history_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        readline.write_history_file(path)
    except OSError as exc:  # a read-only home: the session worked, only its history is not kept
        print(f"kvcore: warning: cannot save the chat history to {path}: {exc.strerror or exc}", file=sys.stderr)
