"""The ``flex`` backend's pieces that are not the backend: a layer's attention as FlexAttention's ``mask_mod`` and
``score_mod``, the shape buckets that keep compiled kernels few, and where inductor keeps compiled kernels.

Positions: the backend lays a call out as ``B`` sequences of ``q_len`` query rows (padded) against ``kv_len`` keys
(padded), so FlexAttention's ``q_idx`` is the row within the sequence's part of this call and ``kv_idx`` the key's
absolute position. The functions here turn ``q_idx`` into the absolute position ``context_lens[b] + q_idx`` before
a layer's mods see it, as :mod:`kvcore.interfaces.variants` promises.
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
from pathlib import Path

import torch

from kvcore.interfaces.layer_attention import LayerAttention
from kvcore.kernels.cpu_kernels import cxx_compiler
from kvcore.paths import cache_root, private_dir, warn_no_cache

__all__ = ["MIN_KEYS", "block_mask", "bucket", "mask_key", "mask_mod", "score_mod", "flex_reason",
           "use_kvcore_inductor_cache"]

#: the fewest keys a call is padded to: FlexAttention's tile (rows and keys) of a block mask, so short contexts
#: share one shape
MIN_KEYS = 128


def bucket(n: int, least: int = 1, most: int | None = None, *, compiled: bool = True) -> int:
    """``n`` rounded up (at most to ``most`` when ``n`` fits it): for a ``compiled`` kernel to a power of two, at
    least ``least``, the sizes it is specialised on, one per octave of lengths rather than one per length; eager,
    where no kernel is reused and every padded row and key costs its share of the dense scores, to a multiple of
    ``least``."""
    size = max(least, 1 << max(n - 1, 0).bit_length()) if compiled else -(-max(n, 1) // least) * least
    return max(n, min(size, most)) if most is not None else size


def mask_key(layer: LayerAttention) -> tuple:
    """What decides a layer's block mask: layers with equal keys share one per call."""
    return (layer.sliding_window, *(mod.mask_mod for mod in layer.mods if mod.mask_mod is not None))


def mask_mod(layer: LayerAttention, context_lens: torch.Tensor, query_lens: torch.Tensor):
    """``layer``'s visibility as a ``mask_mod``: causal at the absolute positions, inside the sliding window, among
    the sequence's real query rows, and every registered ``mask_mod`` of the layer ANDed.

    :param context_lens: ``[B]`` int64, cached tokens before each sequence's first query row.
    :param query_lens: ``[B]`` int64, each sequence's real query rows (the rest of ``q_len`` is padding).
    """
    window, mods = layer.sliding_window, [mod.mask_mod for mod in layer.mods if mod.mask_mod is not None]

    def visible(b, h, q_idx, kv_idx):
        q_pos = context_lens[b] + q_idx
        # keys past a sequence's length (padding) lie in the future of all its real rows
        seen = (kv_idx <= q_pos) & (q_idx < query_lens[b])
        if window is not None:
            seen = seen & (q_pos - kv_idx < window)
        for fn in mods:
            seen = seen & fn(b, h, q_pos, kv_idx)
        return seen

    return visible


def block_mask(layer: LayerAttention, context_lens: torch.Tensor, query_lens: torch.Tensor, q_len: int,
               kv_len: int, num_heads: int | None):
    """``layer``'s :func:`mask_mod` as FlexAttention's block mask over ``[B, q_len, kv_len]`` (the same for every
    head unless ``num_heads`` is given). ``create_block_mask`` evaluates the mask on every (row, key), which costs
    milliseconds per decode step even at one row; without a registered ``mask_mod`` the visible region of a tile of
    rows is one range of keys, so its tiles are counted here instead."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    mask = mask_mod(layer, context_lens, query_lens)
    if any(mod.mask_mod is not None for mod in layer.mods):
        return create_block_mask(mask, len(query_lens), num_heads, q_len, kv_len, device=context_lens.device)
    device, window = context_lens.device, layer.sliding_window
    row_lo = torch.arange(-(-q_len // MIN_KEYS), device=device) * MIN_KEYS  # [QB] first row of each tile
    rows_end = torch.clamp(row_lo + MIN_KEYS, max=q_len)  # [QB] past its last row
    real = query_lens[:, None]  # [B, 1]
    p_lo = context_lens[:, None] + row_lo  # [B, QB] positions of a tile's first and last real row
    p_hi = context_lens[:, None] + torch.minimum(rows_end, real) - 1
    # keys some row sees: p_lo - window + 1 .. p_hi; keys every row sees: p_hi - window + 1 .. p_lo
    first = (p_lo - window + 1).clamp(min=0) // MIN_KEYS if window else torch.zeros_like(p_lo)
    full_first = -(-(p_hi - window + 1).clamp(min=0) // MIN_KEYS) if window else torch.zeros_like(p_lo)
    tiles = first[..., None] + torch.arange(-(-kv_len // MIN_KEYS), device=device)  # [B, QB, KB] candidates
    seen = (tiles <= (p_hi // MIN_KEYS)[..., None]) & (row_lo < real)[..., None]
    full = (seen & (rows_end <= real)[..., None] & (tiles >= full_first[..., None])
            & (tiles <= ((p_lo + 1) // MIN_KEYS - 1)[..., None]))

    def packed(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(count [B, 1, QB], tile indices [B, 1, QB, KB])`` of the ``chosen`` tiles, first and in order."""
        order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)
        indices = tiles.gather(-1, order).clamp(max=tiles.shape[-1] - 1)
        return chosen.sum(-1, dtype=torch.int32)[:, None], indices.to(torch.int32)[:, None]

    return BlockMask.from_kv_blocks(*packed(seen & ~full), *packed(full), BLOCK_SIZE=MIN_KEYS, mask_mod=mask,
                                    seq_lengths=(q_len, kv_len), compute_q_blocks=False)


def score_mod(layer: LayerAttention, context_lens: torch.Tensor):
    """``layer``'s score changes as a ``score_mod`` (None: it has none): the soft-cap first, then each registered
    ``score_mod`` in order, on the scaled score."""
    cap, mods = layer.softcap, [mod.score_mod for mod in layer.mods if mod.score_mod is not None]
    if cap is None and not mods:
        return None

    def modified(score, b, h, q_idx, kv_idx):
        if cap is not None:
            score = torch.tanh(score / cap) * cap
        q_pos = context_lens[b] + q_idx
        for fn in mods:
            score = fn(score, b, h, q_pos, kv_idx)
        return score

    return modified


def flex_reason() -> str | None:
    """Why FlexAttention cannot run compiled here (None: it can): torch too old, or no C++ compiler on a machine
    without CUDA (inductor's CPU kernels are C++)."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no FlexAttention with AuxRequest (torch.nn.attention.flex_attention)"
    cxx = cxx_compiler()
    if not torch.cuda.is_available() and not (cxx and shlex.split(cxx) and shutil.which(shlex.split(cxx)[0])):
        found = f"CXX={cxx!r} names no program on PATH" if cxx else "no g++ or clang++ on PATH (or set CXX)"
        return (f"torch.compile of flex_attention on CPU generates C++: {found}; compile = false in "
                "[backends.flex] runs it eagerly")
    return None


def use_kvcore_inductor_cache() -> Path:
    """Point inductor's on-disk caches (compiled kernels, FX graphs; ``TORCHINDUCTOR_CACHE_DIR``, process-wide) at
    ``<kvcore cache>/inductor`` so a second process loads what the first compiled. Its default is a folder in the
    shared temporary directory, which kvcore does not load code from. The folder gets the kernel cache's rules
    (:mod:`kvcore.paths`): private, the user's own, no link (else :class:`~kvcore.errors.CacheTrustError`). A
    ``TORCHINDUCTOR_CACHE_DIR`` the user set stays; a folder that cannot be made means a private temporary one for
    this process, with one warning. Returns the folder in use."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    folder = cache_root() / "inductor"
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and chosen not in (default_cache_dir(), str(folder)):
        return Path(chosen)
    try:
        private_dir(folder, cache_root())
    except OSError as exc:
        warn_no_cache("compiled-kernel", folder, exc)
        folder = Path(tempfile.mkdtemp(prefix="kvcore-inductor-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder
