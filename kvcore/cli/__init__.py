"""The ``kvcore`` command line (entry point ``kvcore = kvcore.cli:main``).

Modules: ``app`` (main: dispatch, exit codes, Ctrl-C, closed stdout), ``parser`` (every built-in
command's flags, plugin commands), ``settings`` (flag > environment > config file > defaults, threads,
the prompt from an argument, standard input or a file), ``generate`` (``generate`` and one-shot ``chat``),
``chat`` (the multi-turn REPL), ``serve``, ``listing`` (``backends``, ``plugins``). ``kvcore conformance``
lives in kvcore.conformance.cli, ``kvcore models`` in kvcore.model.families, ``kvcore bench`` in kvcore-bench.

Importing this package is light (no torch): a Ctrl-C while torch loads is handled by :func:`main`.
"""

from kvcore.cli.app import main
from kvcore.cli.parser import build_parser
from kvcore.cli.settings import resolve_settings

__all__ = ["main", "build_parser", "resolve_settings"]
