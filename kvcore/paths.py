"""Where kvcore keeps its on-disk state (layer 0: no kvcore imports)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """kvcore's on-disk cache: ``$KVCORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvcore``, else ``~/.cache/kvcore``."""
    root = os.environ.get("KVCORE_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "kvcore")
    return Path(root)
