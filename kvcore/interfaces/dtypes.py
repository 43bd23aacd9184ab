"""A torch dtype's name as kvcore's users write it (``bfloat16``, not ``torch.bfloat16``): in configs, on the CLI,
in reasons and reports."""

from __future__ import annotations

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``."""
    return str(dtype).removeprefix("torch.")
