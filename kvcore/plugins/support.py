"""Support tables of the registered plugins, generated from their declared capabilities (never by hand)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcore.interfaces.dtypes import dtype_name
from kvcore.plugins.registry import PluginEntry, PluginRegistry

__all__ = ["backend_rows", "plugin_rows", "format_table", "markdown_table"]

COLUMNS = ("backend", "plugin", "available", "devices", "dtypes", "head_dims", "gqa", "kv_layouts", "phases",
           "variants")
#: short names of the attention variants in the table
_VARIANT_NAMES = {"sliding_window": "window", "softcap": "softcap", "sinks": "sinks"}


def _variants(caps) -> str:
    """``window,softcap,sinks`` when both phases serve the same; ``prefill: ...; decode: ...`` otherwise; ``code``
    when the backend evaluates registered variants as code (both phases)."""
    def names(variants) -> str:
        shown = [_VARIANT_NAMES[v] for v in _VARIANT_NAMES if v in variants]
        shown += sorted(set(variants) - set(_VARIANT_NAMES))  # registered variants it implements natively
        return ",".join(shown + (["code"] if caps.variants_as_code else [])) or "-"

    if caps.prefill_variants == caps.decode_variants:
        return names(caps.prefill_variants)
    return f"prefill: {names(caps.prefill_variants)}; decode: {names(caps.decode_variants)}"


def _dtype_names(dtypes) -> str:
    order = {"float32": 0, "bfloat16": 1, "float16": 2}
    names = [dtype_name(d) for d in dtypes]
    return ",".join(sorted(names, key=lambda n: order.get(n, 9)))


def _availability(entry: PluginEntry) -> str:
    reason = entry.availability()
    return "yes" if reason is None else f"no: {reason}"


def backend_rows(registry: PluginRegistry) -> list[dict[str, Any]]:
    rows = []
    for name in sorted(registry.backends):
        entry = registry.backends[name]
        caps = entry.cls.capabilities
        if caps.head_dims is not None:
            head_dims = ",".join(str(d) for d in sorted(caps.head_dims))
        elif caps.max_head_dim is not None:
            head_dims = f"<={caps.max_head_dim}"
        else:
            head_dims = "any"
        if caps.head_dim_multiple:
            head_dims += f" (x{caps.head_dim_multiple})"
        phases = [p for p, ok in (("prefill", caps.supports_prefill), ("decode", caps.supports_decode)) if ok]
        rows.append(
            {
                "backend": name,
                "plugin": entry.plugin,
                "available": _availability(entry),
                "devices": ",".join(sorted(caps.devices)),
                "dtypes": _dtype_names(caps.dtypes),
                "head_dims": head_dims,
                "gqa": "yes" if caps.supports_gqa else "no",
                "kv_layouts": ",".join(caps.kv_layouts),
                "phases": ",".join(phases),
                "variants": _variants(caps),
                "description": entry.cls.description,
            }
        )
    return rows


def plugin_rows(registry: PluginRegistry) -> dict[str, list[dict[str, Any]]]:
    """Rows of every pluggable kind: ``{"backends": [...], "kv_caches": [...], "samplers": [...],
    "proposers": [...], "attention_variants": [...]}``; a variant's ``backends`` serve it in both phases."""
    caches = []
    for name in sorted(registry.kv_caches):
        entry = registry.kv_caches[name]
        caps = entry.cls.capabilities
        caches.append({
            "kv_cache": name,
            "plugin": entry.plugin,
            "layout": entry.cls.layout,
            "paged": "yes" if entry.cls.paged else "no (slot per sequence)",
            "devices": ",".join(sorted(caps.devices)),
            "dtypes": _dtype_names(caps.dtypes),
            "precision": caps.precision or "lossless",
            "window_pool": "yes" if caps.no_window_pool is None else "no",
            "available": _availability(entry),
            "description": entry.cls.description,
        })
    samplers = [
        {"sampler": name, "plugin": e.plugin, "available": _availability(e), "description": e.cls.description}
        for name, e in sorted(registry.samplers.items())
    ]
    proposers = [
        {"proposer": name, "plugin": e.plugin, "deterministic": "yes" if e.cls.capabilities.deterministic else "no",
         "available": _availability(e), "description": e.cls.description}
        for name, e in sorted(registry.proposers.items())
    ]
    variants = [
        {"attention_variant": name, "plugin": e.plugin,
         "backends": ",".join(b for b, be in sorted(registry.backends.items())
                              if not be.cls.capabilities.reasons_variants([name])) or "-",
         "available": _availability(e), "description": e.cls.description}
        for name, e in sorted(registry.attention_variants.items())
    ]
    return {"backends": backend_rows(registry), "kv_caches": caches, "samplers": samplers, "proposers": proposers,
            "attention_variants": variants}


def format_table(rows: list[dict[str, Any]], notes: Callable[[dict[str, Any]], list[str]] | None = None) -> str:
    """Fixed-width text table; the availability reason, and each of ``notes(row)``, go on a line of their own
    under the row. A column holding a dict (details for ``notes``) is not shown."""
    if not rows:
        return "(none registered)"
    keys = [c for c in rows[0] if c != "description" and not isinstance(rows[0][c], dict)]
    cols = [c for c in keys if c != "available"] + ["available"]
    shown = [{c: (r[c] if c != "available" else r[c].split(":")[0]) for c in cols} for r in rows]
    widths = {c: max(len(c), *(len(str(r[c])) for r in shown)) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols).rstrip()]
    for row, full in zip(shown, rows):
        lines.append("  ".join(str(row[c]).ljust(widths[c]) for c in cols).rstrip())
        if full["available"] != "yes":
            lines.append(f"    why unavailable: {full['available'].removeprefix('no: ')}")
        lines += [f"    {note}" for note in (notes(full) if notes else [])]
    return "\n".join(lines)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Capabilities only (availability depends on the machine, so it stays out of the docs)."""
    cols = [c for c in COLUMNS if c not in ("plugin", "available")] + ["description"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[c]).replace("|", "\\|") for c in cols) + " |")
    return "\n".join(lines)
