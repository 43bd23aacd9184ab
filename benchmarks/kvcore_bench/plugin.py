"""Adds ``kvcore bench`` to the ``kvcore`` command line (advertised as entry point ``bench``)."""

from __future__ import annotations

from kvcore.hookspecs import hookimpl
from kvcore_bench.bench import add_parser


@hookimpl
def kvcore_register_commands(subparsers) -> None:
    add_parser(subparsers)
