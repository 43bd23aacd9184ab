"""What a native decode stack needs of a backend: one forward call's cache writes and attention, as data.

A model whose layers run as kvcore's fused operators can run all but its first layer as one native call,
``torch.ops.kvcore.decode_stack`` (:mod:`kvcore.model.fused_layer`), when the backend's attention for the whole
call is ``cached_decode_attention`` calls over a contiguous cache. A backend that can say so declares
``BackendCapabilities.decode_stack`` and returns a :class:`DecodeStack` from ``decode_stack(plan, cache)`` for the
calls it serves that way (None for the others, which keep the per-layer path). The model never sees the cache
or the backend: only these tensors and numbers, which it passes to the operator as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DecodeStack"]


@dataclass(frozen=True, eq=False)  # tensors: compared by identity
class DecodeStack:
    """The attention of every layer of one forward call, as ``cached_decode_attention`` arguments.

    The call's ``T`` tokens form consecutive *call groups*, each one ``cached_decode_attention`` call per layer:
    ``B_g`` sequences of ``R_g`` tokens each (``T_g = B_g R_g``, ``R_g <= 16``) on the consecutive cache slots
    ``first_slots[g] ..``, token ``t`` of a sequence attending to its own causal length.
    """

    k_cache: torch.Tensor  #: [L, S, H_kv, S_max, D] contiguous, the model dtype, written in place
    v_cache: torch.Tensor  #: [L, S, H_kv, S_max, D], like ``k_cache``
    rows: tuple[torch.Tensor, ...]  #: per group: [L, T_g * H_kv] int64 cache row of each (layer, token, KV head)
    seq_lens: tuple[torch.Tensor, ...]  #: per group: [B_g] int32 keys of each sequence's last token
    first_slots: tuple[int, ...]  #: per group: the slot of its first sequence
    max_lens: tuple[int, ...]  #: per group: keys read (at least its longest seq_len)
    scales: tuple[float, ...]  #: per layer: the softmax scale
    windows: tuple[int, ...]  #: per layer: the sliding window (0: none)
    softcaps: tuple[float, ...]  #: per layer: the score soft-cap (0.0: none)

    def op_args(self) -> tuple:
        """The operator's arguments after ``num_heads``, in its order."""
        return (self.k_cache, self.v_cache, self.rows, self.seq_lens, self.first_slots, self.max_lens, self.scales,
                self.windows, self.softcaps)
