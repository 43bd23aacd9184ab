"""Adds ``kvcore bench`` to the ``kvcore`` command line (advertised as entry point ``bench``).

The hook runs on every ``kvcore`` start: it only declares the command; the harness (:mod:`kvcore_bench.bench`)
is imported when ``kvcore bench`` runs.
"""

from __future__ import annotations

import argparse

from kvcore.hookspecs import hookimpl


def _run(args: argparse.Namespace) -> int:
    from kvcore_bench.bench import run

    return run(args)


@hookimpl
def kvcore_register_commands(subparsers) -> None:
    from kvcore_bench.cli import add_parser

    add_parser(subparsers, _run)
