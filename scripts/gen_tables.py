"""Write the documentation tables that have a source of truth elsewhere: docs/cli.md's settings table (from the
declared fields of kvcore.engine.fields.SETTINGS) and docs/design.md's layer table (from tests/layer_order.py).

    .venv/bin/python scripts/gen_tables.py           # rewrite the tables in place
    .venv/bin/python scripts/gen_tables.py --check   # exit 1 when a page's table is stale

Each table stands between ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->``; the prose around it is
the page's own. tests/e2e/test_docs.py fails while a table is stale.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

from kvcore.engine.fields import SETTINGS
from kvcore.interfaces.setting import Declared, declared

ROOT = Path(__file__).resolve().parent.parent
COMMAND = ".venv/bin/python scripts/gen_tables.py"
#: who sets each group's values, for its heading in the settings table
GROUPS = {"engine": "Engine (`kvcore.EngineConfig`; flags of `generate`, `chat` and `serve`)",
          "sampling": "Sampling (`kvcore.SamplingParams`, per request; flags of `generate` and `chat`)",
          "run": "Run (`kvcore.Settings`; flags of `generate`, `chat` and `serve`)"}
_KINDS = {bool: "bool", int: "int", float: "float", str: "string", tuple: "list of strings", dict: "tables"}


def _layers() -> list[tuple[tuple[str, ...], str]]:
    """tests/layer_order.py's LAYERS, imported from its path (test data, not part of the package)."""
    spec = importlib.util.spec_from_file_location("layer_order", ROOT / "tests" / "layer_order.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LAYERS


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _toml(value: object) -> str:
    """A default as the config file writes it; ``""`` for None (the setting's text says what applies)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{list(value) if isinstance(value, tuple) else value}`"


def _row(d: Declared) -> str:
    key = f"`[{d.setting.table}.<name>]`" if d.setting.table else f"`{d.name}`"
    flag = "" if d.flag is None else f"`{d.flag}`"
    if flag and d.setting.commands:
        flag += f" ({', '.join(d.setting.commands)})"
    default = "" if d.kind is dict else _toml(d.default)
    return f"| {key} | {flag} | {_KINDS[d.kind]} | {default} | {_cell(d.help)} |"


def render_settings() -> str:
    parts = []
    for group, heading in GROUPS.items():
        rows = [_row(d) for d in declared(SETTINGS[group])]
        parts.append(f"{heading}:\n\n| key | flag | type | default | meaning |\n|---|---|---|---|---|\n"
                     + "\n".join(rows) + "\n")
    return "\n".join(parts)


def render_layers() -> str:
    rows = ["| rank | packages | what lives there |", "|---|---|---|"]
    for rank, (packages, holds) in enumerate(_layers()):
        names = ", ".join(f"`{p.removeprefix('kvcore.')}`" for p in packages)
        rows.append(f"| {rank} | {names} | {_cell(holds)} |")
    return "\n".join(rows) + "\n"


#: page → (table name, renderer)
TABLES = {"docs/cli.md": ("settings", render_settings), "docs/design.md": ("layers", render_layers)}


def regenerate(text: str, name: str, body: str) -> str:
    """``text`` with the table ``name`` replaced by ``body``; ValueError when the page has no such table."""
    pattern = re.compile(rf"(<!-- generated: {name} [^\n]*-->\n).*?(<!-- end: {name} -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"no '<!-- generated: {name} ... -->' ... '<!-- end: {name} -->' block")
    return pattern.sub(lambda m: m.group(1) + "\n" + body + "\n" + m.group(2), text, count=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 when stale")
    args = parser.parse_args(argv)
    stale = []
    for page, (name, render) in TABLES.items():
        path = ROOT / page
        text = path.read_text(encoding="utf-8")
        new = regenerate(text, name, render())
        if new == text:
            continue
        if args.check:
            stale.append(page)
            print(f"{page}: the {name} table is stale: run `{COMMAND}`", file=sys.stderr)
        else:
            path.write_text(new, encoding="utf-8")
            print(f"wrote {page}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
