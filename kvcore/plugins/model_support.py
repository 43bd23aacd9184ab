"""Rows of ``kvcore models``: each registered architecture, what it reads, and the backends that serve it."""

from __future__ import annotations

from typing import Any

from kvcore.interfaces.layer_attention import VARIANTS
from kvcore.plugins.registry import ARCHITECTURE, PluginRegistry

__all__ = ["architecture_rows", "serving_backends", "unserved_reasons", "unserved_note", "markdown_rows"]


def serving_backends(registry: PluginRegistry, arch: type) -> tuple[list[str], list[str]]:
    """(backends whose capabilities declare every attention variant ``arch`` may use, in both phases; the
    variants no backend serves, as reasons say them: "soft-capping")."""
    backends = sorted(registry.backends.items())
    served = [name for name, e in backends if not e.cls.capabilities.reasons_variants(arch.attention_features)]
    missing = [VARIANTS[f] for f in arch.attention_features
               if all(e.cls.capabilities.reasons_variants([f]) for _, e in backends)]
    return served, missing


def unserved_reasons(registry: PluginRegistry, arch: type) -> dict[str, str]:
    """``{backend: why it does not serve arch}`` for each registered backend missing a variant ``arch`` may use
    ("no sliding windows", or per phase: "decode: no soft-capping"): why a backend is left out of its row."""
    reasons = {}
    for name, entry in sorted(registry.backends.items()):
        missing = entry.cls.capabilities.reasons_variants(arch.attention_features)
        tails = {reason.split(": ", 1)[1] for reason in missing}
        if len(missing) == 2 and len(tails) == 1:  # the same in both phases: say it once
            reasons[name] = tails.pop()
        elif missing:
            reasons[name] = "; ".join(missing)
    return reasons


def architecture_rows(registry: PluginRegistry) -> list[dict[str, Any]]:
    """One row per architecture, generated from the declarations (no hand-written table)."""
    rows = []
    for name, entry in sorted(registry.entries(ARCHITECTURE).items()):
        arch = entry.cls
        served, missing = serving_backends(registry, arch)
        options = ", ".join(f"{k}={v}" for k, v in sorted(arch.options.items())) or "-"
        rows.append({
            "architecture": name,
            "plugin": entry.plugin,
            "hugging_face": ",".join(arch.hf_architectures) or "-",
            "gguf": arch.gguf_arch or "-",
            "options": options,
            "fused_weights": ",".join(arch.hf_fused) or "-",
            "backends": ",".join(served) if served else f"none (needs: {', '.join(missing)})",
            "available": "yes",  # a declaration needs nothing installed
            "description": arch.description,
            # the backends left out of "backends", each with the variant it lacks (text: a line under the row)
            "unserved_by": unserved_reasons(registry, arch),
        })
    return rows


def markdown_rows(rows: list[dict[str, Any]]) -> str:
    """The README's table: what each architecture reads and which backends serve it."""
    cols = ["architecture", "hugging_face", "gguf", "options", "fused_weights", "backends"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[c]).replace("|", "\\|") for c in cols) + " |")
    return "\n".join(lines)


def unserved_note(row: dict[str, Any]) -> list[str]:
    """A row's line under it in ``kvcore models``' table: the backends that do not serve it, and why."""
    unserved = row["unserved_by"]
    return [f"not served by: {', '.join(f'{b} ({why})' for b, why in unserved.items())}"] if unserved else []
