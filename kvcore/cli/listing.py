"""``kvcore plugins``, ``kvcore backends`` and ``kvcore models``: what is registered, and whether it can run here."""

from __future__ import annotations

import argparse
import json

__all__ = ["run_plugins", "run_backends", "run_models"]


def run_plugins(args: argparse.Namespace) -> int:
    from kvcore.plugins.registry import get_registry
    from kvcore.plugins.support import format_table, plugin_rows

    rows = plugin_rows(get_registry())
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for kind, kind_rows in rows.items():
        print(f"{kind}:")
        print(format_table(kind_rows))
        print()
    return 0


def run_backends(args: argparse.Namespace) -> int:
    from kvcore.plugins.registry import get_registry
    from kvcore.plugins.support import backend_rows, format_table, markdown_table

    return _show(args, backend_rows(get_registry()), markdown_table, format_table)


def run_models(args: argparse.Namespace) -> int:
    from kvcore.plugins.model_support import architecture_rows, markdown_rows, unserved_note
    from kvcore.plugins.registry import get_registry
    from kvcore.plugins.support import format_table

    return _show(args, architecture_rows(get_registry()), markdown_rows,
                 lambda rows: format_table(rows, notes=unserved_note))


def _show(args: argparse.Namespace, rows: list[dict], markdown, table) -> int:
    """Print ``rows`` as ``--json``, ``--markdown`` (``markdown(rows)``) or a terminal table (``table(rows)``)."""
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(markdown(rows) if args.markdown else table(rows))
    return 0
