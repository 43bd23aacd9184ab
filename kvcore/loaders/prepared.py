"""A decoder's run-time weights that are no parameters or buffers, as named tensors and a JSON description.

A quantized decoder runs its layer matmuls on weights packed for kvcore's kernels (``model._quantized``), scores
its LM head with a packed copy of the head (``model.head_int4`` or ``model.head_int8``), and may hold its token
table as the GGUF file's blocks (``model.embedding``). Packing is a pass over every weight of the file;
:mod:`kvcore.loaders.model_cache` saves what it made with :func:`runtime_state` and gives it back to a later start
with :func:`restore_runtime`, the tensors then being pages of the cache file, mapped and read on first use.

Only formats named in :data:`SAVED_FORMATS` are saved, each rebuilt from its tensors and its shape, group size and
dtype (nothing else of an entry is turned into an object); a model holding any other kind of matmul is not saved.
"""

from __future__ import annotations

from typing import Any

import torch
from gguf import GGMLQuantizationType as QType

from kvcore.kernels.cpu_kernels import kernel_reasons, load_kernels
from kvcore.kernels.group_quant import Int8GroupLinear
from kvcore.kernels.huge_pages import Relocatable, move_into_huge_pages
from kvcore.kernels.quant import Int4A8Linear, Int4Linear
from kvcore.loaders.gguf_blocks import GGUFBlocks, file_blocks
from kvcore.model.embedding import BlockTable, head_rows
from kvcore.model.fused_layer import fused_layer_reasons
from kvcore.model.lm_head import int4a8_in_chunks, int8_linear
from kvcore.model.weights import LINEAR_PARTS

__all__ = ["SAVED_FORMATS", "into_huge_pages", "prepare_head", "runtime_state", "restore_runtime"]

#: the matmul weight classes an entry may hold, by name, with the attributes holding their tensors
SAVED_FORMATS: dict[str, tuple[type, tuple[str, ...]]] = {
    "int4a8": (Int4A8Linear, ("codes", "dm")),
    "int8_group": (Int8GroupLinear, ("packed", "dm")),
}
_NAMES = {cls: name for name, (cls, _) in SAVED_FORMATS.items()}


def prepare_head(model: torch.nn.Module, lm_head: str) -> None:
    """Give a model whose weights run on kvcore's int8-activation kernels the packed copy of its LM head that the
    ``lm_head`` format scores with, so that it is saved with them: the int4a8 copy of the ``int4`` head
    (:class:`~kvcore.model.lm_head.RescoredInt4Head`), the 8-bit codes of the ``int8`` one
    (:class:`~kvcore.model.lm_head.Int8Head`). Nothing for other formats, or where that head cannot run here."""
    if getattr(model, "weight_format", "float") not in ("int4a8", "gguf") or kernel_reasons():
        return
    rows = head_rows(model)
    if lm_head == "int4" and model.head_int4 is None and Int4Linear.fits(*rows.shape, 32):
        model.head_int4 = int4a8_in_chunks(rows)
    if lm_head == "int8" and model.head_int8 is None and Int8GroupLinear.fits(*rows.shape, 32):
        model.head_int8 = int8_linear(rows)


def into_huge_pages(model: torch.nn.Module) -> None:
    """Move the model's packed weights (layer matmuls, packed heads) into one huge-page arena: for a model built under
    :func:`~kvcore.kernels.huge_pages.plain_pages` to be saved whose entry was not written after all."""
    objects = [f for fns in (model._quantized or {}).values() for f in fns if isinstance(f, Relocatable)]
    objects += [head for head in (model.head_int4, model.head_int8) if isinstance(head, Relocatable)]
    move_into_huge_pages(objects)


def _linear_state(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    name = _NAMES.get(type(obj))
    if name is None:
        return None
    layouts = {}
    for attr in SAVED_FORMATS[name][1]:
        t = getattr(obj, attr)
        # as bytes: the packed weights are views of one huge-page arena in several dtypes, and a saved storage
        # has one dtype; saved so, the arena is written once and mapped back whole
        tensors[f"{prefix}.{attr}"] = t.view(torch.uint8)
        layouts[attr] = [str(t.dtype).removeprefix("torch."), list(t.shape)]
    return {"format": name, "shape": list(obj.shape), "group_size": obj.group_size, "dtype": str(obj.dtype),
            "tensors": layouts}


def _linear(info: dict[str, Any], prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    cls, attrs = SAVED_FORMATS[info["format"]]
    obj = cls.__new__(cls)  # its tensors are the saved ones: nothing to pack again
    obj.shape, obj.group_size = tuple(info["shape"]), int(info["group_size"])
    obj.dtype = getattr(torch, info["dtype"].removeprefix("torch."))
    for attr in attrs:
        dtype, shape = info["tensors"][attr]
        setattr(obj, attr, tensors[f"{prefix}.{attr}"].view(getattr(torch, dtype)).view(shape))
    return obj


def runtime_state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """``(tensors, description)`` of the model's weights that are no parameters or buffers, or None when one of
    them has no saved form (the model is then not saved). A float model has none: ``({}, {})``."""
    tensors: dict[str, torch.Tensor] = {}
    info: dict[str, Any] = {}
    if model._quantized is not None:
        info["quantized"] = {}
        for name, layers in model._quantized.items():
            states = [_linear_state(obj, f"quantized.{name}.{i}", tensors) for i, obj in enumerate(layers)]
            if None in states:
                return None
            info["quantized"][name] = states
        info["weight_format"] = model.weight_format
    for name in ("head_int4", "head_int8"):
        if getattr(model, name) is not None:
            info[name] = _linear_state(getattr(model, name), name, tensors)
    if model.embedding is not None:
        blocks = model.embedding.blocks
        source = None if blocks is None else blocks.file_range
        if source is None or not blocks.in_file:  # only a table read from the model file as stored is described
            return None
        info["embedding"] = {"qtype": int(blocks.qtype), "shape": list(blocks.shape), "path": source.path,
                             "offset": source.offset, "nbytes": source.nbytes}
    return tensors, info


def restore_runtime(model: torch.nn.Module, tensors: dict[str, torch.Tensor], info: dict[str, Any]) -> None:
    """Give ``model`` (assembled from an entry's parameters and buffers) the weights :func:`runtime_state`
    described. KeyError or ValueError when the entry does not hold what its description names."""
    if info.get("quantized") or "head_int4" in info or "head_int8" in info:  # operators of kvcore's kernels
        load_kernels()
    if "quantized" in info:
        if set(info["quantized"]) != set(LINEAR_PARTS):
            raise ValueError("entry holds another set of matmuls")
        model._quantized = {name: [_linear(state, f"quantized.{name}.{i}", tensors) for i, state in enumerate(states)]
                            for name, states in info["quantized"].items()}
        model.weight_format = info["weight_format"]
        model.fused_norm = model.weight_format == "int4a8"
    for name in ("head_int4", "head_int8"):
        if name in info:
            setattr(model, name, _linear(info[name], name, tensors))
    if "embedding" in info:
        e = info["embedding"]
        blocks = GGUFBlocks(QType(e["qtype"]), file_blocks(e["path"], e["offset"], e["nbytes"]), tuple(e["shape"]))
        model.embedding = BlockTable(blocks.lookup_table(), model.dtype)
    if "quantized" in info:
        model.fused_layers = not fused_layer_reasons(model)
