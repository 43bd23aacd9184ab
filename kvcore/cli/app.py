"""The ``kvcore`` entry point: dispatch a command and turn every way it can end into one line and an exit code.

Exit codes (README, "Errors"): 0 success; a :class:`~kvcore.errors.KVCoreError`'s ``exit_code`` (2 usage,
config or request, 3 model, 4 backend or sampler, 5 backend unavailable, 6 out of cache, 7 tensor-parallel
group); 130 interrupted (Ctrl-C, at any moment: start-up, model load, generation); 141 standard output
closed (``| head -c1``, ``>&-``); 74 standard output cannot be written (full disk); 70 a bug in kvcore
(``internal error``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import warnings

from kvcore.cli.generate import RunState
from kvcore.errors import KVCoreError, OutputError

__all__ = ["main", "EXIT_INTERRUPTED", "EXIT_OUTPUT_CLOSED", "EXIT_INTERNAL"]

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a process Ctrl-C ended
EXIT_OUTPUT_CLOSED = 141  # 128 + SIGPIPE, what `yes | head -1` reports for `yes`
EXIT_INTERNAL = 70  # EX_SOFTWARE: a bug in kvcore
_WRITES_STDOUT = ("generate", "chat")


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    text = str(message)
    print(text if text.startswith("kvcore:") else f"kvcore: warning: {text}", file=sys.stderr)


def _dispatch(argv: list[str], state: RunState) -> int:
    from kvcore.cli.parser import parse_args
    from kvcore.engine.file_config import errors_located

    args = parse_args(argv)
    with errors_located(getattr(args, "config", None)):  # e.g. an option a plugin rejected: the file's line
        return _run(args, state)


def _run(args, state: RunState) -> int:
    if args.command in _WRITES_STDOUT and sys.stdout is None:  # started with stdout closed (`>&-`)
        return EXIT_OUTPUT_CLOSED
    if args.command == "generate":
        from kvcore.cli.generate import run_generate

        return run_generate(args, state)
    if args.command == "chat":
        from kvcore.cli.chat import run_chat

        return run_chat(args, state)
    if args.command == "serve":
        from kvcore.cli.serve import run_serve

        return run_serve(args)
    if args.command == "kernels":
        from kvcore.cli.kernels import run_kernels

        return run_kernels(args)
    if args.command in ("backends", "plugins", "models"):
        from kvcore.cli import listing

        run = {"backends": listing.run_backends, "plugins": listing.run_plugins, "models": listing.run_models}
        return run[args.command](args)
    return args.func(args)


class _Sigint:
    """Ctrl-C raises KeyboardInterrupt as usual, and is also counted: native code that calls back into Python
    (safetensors' loader, for one) may turn the KeyboardInterrupt into another error, which must still end
    the run as an interruption."""

    def __init__(self) -> None:
        self.count = 0
        self.previous = None

    def __enter__(self) -> _Sigint:
        # only the default handler is replaced (not an embedding program's own), and only in the main thread
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.count += 1
        raise KeyboardInterrupt

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def main(argv: list[str] | None = None) -> int:
    with _Sigint() as sigint:
        return _main(sys.argv[1:] if argv is None else list(argv), sigint)


def _main(argv: list[str], sigint: _Sigint) -> int:
    # Known before parsing: parsing may load plugins, whose load warnings are one line each; an interruption
    # while they load must still print JSON.
    debug = "--debug" in argv or os.environ.get("KVCORE_DEBUG") == "1"
    command = next((a for a in argv if not a.startswith("-")), None)
    state = RunState(json="--json" in argv and command in _WRITES_STDOUT)
    try:
        if not debug:
            # third-party library chatter; deprecations are for developers (torch's own imports raise some)
            for category in (UserWarning, DeprecationWarning, PendingDeprecationWarning):
                warnings.simplefilter("ignore", category)
            warnings.showwarning = _one_line_warning
        try:
            code = _dispatch(argv, state)
            if state.end_process is not None:
                state.end_process()
                _end_now(code)
            return code
        except KVCoreError as exc:
            if sigint.count and not debug:  # a Ctrl-C that a library turned into this error
                return _interrupted(state)
            if debug:
                raise
            print(f"kvcore: error: {exc}", file=sys.stderr)
            if isinstance(exc, OutputError):  # what is still buffered would fail again at exit, with a warning
                _output_closed()
            if exc.end_process:
                _end_now(exc.exit_code)
            return exc.exit_code
    except KeyboardInterrupt:
        if debug:
            raise
        return _interrupted(state)
    except BrokenPipeError:
        return _output_closed()
    except Exception as exc:  # a bug: still one line, with a hint to get the traceback
        if sigint.count and not debug:
            return _interrupted(state)
        if debug:
            raise
        print(f"kvcore: internal error: {type(exc).__name__}: {exc} (rerun with --debug for a traceback)",
              file=sys.stderr)
        return EXIT_INTERNAL


def _end_now(code: int) -> None:
    """End the process with ``code`` without the interpreter's teardown (see ``KVCoreError.end_process``)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed reader: nothing more can be written anyway
            pass
    os._exit(code)


def _interrupted(state: RunState) -> int:
    """One line on stderr; with ``--json``, the result object of what was generated so far."""
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut this short with a traceback
    try:
        print("kvcore: interrupted", file=sys.stderr)
        if state.json and sys.stdout is not None:
            payload = state.partial() if state.partial is not None else None
            if payload is None:  # before a request started (imports, model load)
                payload = {"prompt_token_ids": [], "token_ids": [], "text": ""}
            payload["finish_reason"] = "interrupted"
            sys.stdout.write(("\n" if payload["text"] else "") + json.dumps(payload) + "\n")
            sys.stdout.flush()
    except BrokenPipeError:
        return _output_closed(EXIT_INTERRUPTED)
    finally:
        signal.signal(signal.SIGINT, previous)
    return EXIT_INTERRUPTED


def _output_closed(code: int = EXIT_OUTPUT_CLOSED) -> int:
    """Standard output's reader went away (`| head -c1`): stop quietly. Python's final flush of stdout at exit
    would fail again and print a warning, so stdout is pointed at /dev/null first."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, AttributeError, ValueError):
        pass
    return code
