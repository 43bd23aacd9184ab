"""``kvcore chat``: one message, or a conversation.

Without a message (or with ``-i``) it is a REPL: each line read is a user turn; the whole conversation so
far goes through the model's chat template every turn, so the model sees the history. ``/reset`` forgets
it (the system message stays), ``/exit`` (or end of input, Ctrl-D) ends the session. On a terminal each
turn is read with a ``>>>`` prompt and Ctrl-C stops the reply being written (the turn is dropped) or,
at the prompt, ends the session; from a pipe, each line is a turn and Ctrl-C ends the session.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvcore.cli.generate import (
    RunState,
    chat_prompt_ids,
    load_engine,
    result_payload,
    run_generate,
    stream_reply,
    write_out,
)
from kvcore.cli.settings import read_prompt
from kvcore.errors import InvalidRequestError

__all__ = ["run_chat"]

COMMANDS = "/reset clears the conversation, /exit (or Ctrl-D) ends it"


def run_chat(args: argparse.Namespace, state: RunState, stdin=None) -> int:
    stdin = stdin or sys.stdin
    first = read_prompt(args, stdin)
    if first is not None and not args.interactive:
        return run_generate(args, state, chat=True, prompt=first)
    if stdin is None:
        raise InvalidRequestError("no message: give it as an argument, or chat on standard input (closed here)")
    tty = stdin.isatty()
    loaded = load_engine(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    if tty:
        print(f"kvcore chat with {loaded.settings['model']}: {COMMANDS}.", file=sys.stderr)
    while True:
        line = first if first is not None else _read_turn(stdin, tty)
        first = None
        if line is None or line.strip() in ("/exit", "/quit"):
            return 0
        line = line.strip()
        if not line:
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
    """The next user turn, or None at end of input."""
    if tty and stdin is sys.stdin:
        try:
            return input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return None
    line = stdin.readline()
    return line if line else None
