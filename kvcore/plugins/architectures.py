"""Finding the registered architecture a checkpoint declares (built-ins and plugins alike)."""

from __future__ import annotations

from typing import Any

from kvcore.errors import ModelLoadError, PluginError
from kvcore.model.architectures import Architecture
from kvcore.plugins.registry import ARCHITECTURE, PluginRegistry, get_registry

__all__ = ["architectures", "for_hf_config", "for_gguf_arch"]


def architectures(registry: PluginRegistry | None = None) -> dict[str, type[Architecture]]:
    """Every registered architecture by name (built-ins and plugins) of ``registry`` (default: the
    process-wide one)."""
    return {name: entry.cls for name, entry in (registry or get_registry()).entries(ARCHITECTURE).items()}


def _no_match(registry: PluginRegistry | None, message: str) -> ModelLoadError:
    """The error for a checkpoint no architecture claims; a name two plugins registered (and so neither
    serves) is a plugin conflict, said as such."""
    conflicts = [m for (kind, _), m in (registry or get_registry()).conflicts.items() if kind == ARCHITECTURE.key]
    if conflicts:
        raise PluginError(f"{message}; {'; '.join(conflicts)}")
    return ModelLoadError(message)


def for_hf_config(cfg: dict[str, Any], where: str, registry: PluginRegistry | None = None) -> type[Architecture]:
    """The architecture a ``config.json`` declares; ModelLoadError naming the supported ones otherwise."""
    archs = architectures(registry)
    declared = cfg.get("architectures") or []
    for arch in archs.values():
        if any(a in arch.hf_architectures for a in declared):
            return arch
    for arch in archs.values():
        if cfg.get("model_type") in arch.hf_model_types:
            return arch
    what = declared[0] if declared else cfg.get("model_type")
    supported = ", ".join(sorted(archs))
    raise _no_match(registry, f"'{where}': unsupported architecture '{what}' (supported: {supported})")


def for_gguf_arch(name: object, where: str, registry: PluginRegistry | None = None) -> type[Architecture]:
    """The architecture of a GGUF ``general.architecture``; ModelLoadError naming the supported ones otherwise."""
    archs = {a.gguf_arch: a for a in architectures(registry).values() if a.gguf_arch}
    if name not in archs:
        supported = ", ".join(sorted(archs))
        raise _no_match(registry, f"'{where}': unsupported architecture '{name}' (supported: {supported})")
    return archs[name]
