"""An on-disk cache of prepared models: a GGUF model's second start skips parsing, checking, packing and relayout.

A cold start of a GGUF model spends most of its time turning the file into the decoder kvcore runs:
reading ~100k metadata values, checking every weight is finite, packing each quantized matmul for kvcore's
kernels (or dequantising it), building the decoder and laying its weights out for the CPU kernels; all of it
grows with the file. :func:`load_pretrained` saves the result once, every parameter and buffer of the built
:class:`~kvcore.model.decoder.DecoderModel` (with its memory layout), its packed matmul weights and int4 head
(:mod:`kvcore.loaders.prepared`), plus the config and tokenizer, and later loads it with ``torch.load(mmap=True)``:
the weights are then pages of the cache file, read on first use and shared by every process that maps them
(the page cache holds one copy), and nothing is copied or converted. A token table kept as the file's blocks
is read from the model file itself, as on a cold start. The entry's file is watched while the model runs
(:mod:`kvcore.loaders.watched`): truncated or written to in place, the engine refuses to use it.

Where: ``$KVCORE_CACHE_DIR/models``, else ``$XDG_CACHE_HOME/kvcore/models``, else
``~/.cache/kvcore/models``; one folder per entry (``model.pt`` + ``meta.json`` + the identity of both, see
:mod:`kvcore.paths`: folders others could write are refused, a damaged entry is rebuilt, and only
folders kvcore wrote are ever deleted; a cache that cannot be written is skipped with a warning). An
entry's key covers the source file (path, size, mtime and a hash of its first MiB), kvcore's and torch's versions,
:data:`CACHE_FORMAT`, and every build option (dtype, device, RoPE table length): a changed file or version
makes a new entry and the stale ones of that file are deleted. At most :data:`MAX_ENTRIES` entries are kept
(least recently used go first).

Off: ``KVCORE_MODEL_CACHE=0`` in the environment, ``Engine.from_pretrained(..., model_cache=False)``, or
``kvcore generate --no-model-cache``. Clear: :func:`clear` (or delete the folder). Only GGUF files on the
CPU are cached (a Hugging Face directory's safetensors already load without conversion), and only models whose
every weight has a saved form (:data:`~kvcore.loaders.prepared.SAVED_FORMATS`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.serialization import config as serialization_config

from kvcore.errors import KVCoreError
from kvcore.kernels.huge_pages import advise_huge_pages, plain_pages
from kvcore.loaders.load import DEFAULT_MODEL, build_model, load_model
from kvcore.loaders.prepared import into_huge_pages, prepare_head, restore_runtime, runtime_state
from kvcore.loaders.resolve import smollm2_path
from kvcore.loaders.watched import WatchedFile
from kvcore.model.config import ModelConfig, check_max_model_len
from kvcore.model.rope import RopeScaling
from kvcore.paths import cache_root, is_entry, private_dir, remove_entry, verify_entry, warn_no_cache, write_entry
from kvcore.text.tokenizer import Tokenizer
from kvcore.version import __version__

__all__ = ["CACHE_FORMAT", "MAX_ENTRIES", "cache_dir", "cache_root", "cache_enabled", "clear", "gguf_source",
           "load_pretrained"]

#: bumped whenever what an entry holds or how the decoder stores its weights changes
CACHE_FORMAT = 4
#: entries kept (each holds a whole model's weights as it runs them)
MAX_ENTRIES = 4
_HEADER_BYTES = 1 << 20


def cache_dir() -> Path:
    """The folder the entries live in (see the module docstring)."""
    return cache_root() / "models"


def cache_enabled(option: bool | None = None) -> bool:
    """``option`` when given, else whether ``KVCORE_MODEL_CACHE`` leaves the cache on (the default)."""
    if option is not None:
        return option
    return os.environ.get("KVCORE_MODEL_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def clear() -> int:
    """Delete every entry (only folders kvcore wrote); returns how many there were."""
    root = cache_dir()
    return sum(remove_entry(p) for p in root.iterdir()) if root.is_dir() else 0


def load_pretrained(
    spec: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
    use_cache: bool | None = None,
    weights: str = "float",
    lm_head: str = "dense",
) -> tuple[nn.Module, Tokenizer]:
    """``(decoder, tokenizer)`` of model ``spec`` (as :func:`kvcore.loaders.load_model` reads it), built as
    :func:`kvcore.loaders.build_model` builds it with matmul weights in the ``weights`` format, through the cache
    when ``spec`` is a GGUF file on the CPU (an entry holds the ``lm_head`` format's packed head too)."""

    def load():
        loaded = load_model(spec, keep_quantized=True)  # blocks are dequantized as the model is built
        check_max_model_len(max_model_len, loaded.config.max_position_embeddings)  # before building anything
        return loaded, build_model(loaded, dtype, device, max_model_len, weights=weights)

    on_cpu = torch.device(device).type == "cpu"
    source = gguf_source(spec) if on_cpu and cache_enabled(use_cache) else None
    if source is None:
        loaded, model = load()
        return model, loaded.tokenizer
    options = {"dtype": str(dtype), "device": str(torch.device(device)), "max_model_len": max_model_len,
               "weights": weights, "lm_head": lm_head}
    key, stamp = _key(source, options)
    try:
        entry = private_dir(cache_dir(), cache_root()) / key
    except OSError as exc:  # read-only, a file in the way: the cache only ever saves time
        warn_no_cache("model", cache_dir(), exc)
        loaded, model = load()
        return model, loaded.tokenizer
    hit = _read(entry)
    if hit is not None:
        return hit
    with plain_pages():  # built to be written, then run from the entry's mapping as every later start runs it
        loaded, model = load()
    written = _write(entry, model, loaded.tokenizer, {"source": str(source), "stamp": stamp, "options": options})
    hit = _read(entry) if written else None
    if hit is None:
        into_huge_pages(model)  # runs as built after all
    return hit or (model, loaded.tokenizer)


def gguf_source(spec: str) -> Path | None:
    """The GGUF file ``spec`` names, or None (a directory, a missing file: not cached)."""
    if str(spec).strip().lower() == DEFAULT_MODEL:
        try:
            return smollm2_path().resolve()
        except KVCoreError:
            return None  # load_model raises the same error with its message
    path = Path(spec).expanduser()
    if not path.is_file():
        return None
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError:
        return None
    return path.resolve() if magic == b"GGUF" else None


def _key(source: Path, options: dict[str, Any]) -> tuple[str, str]:
    """``(entry key, file stamp)``: the stamp identifies the file's version; the key adds everything else."""

    st = source.stat()
    with source.open("rb") as f:
        header = hashlib.sha256(f.read(_HEADER_BYTES)).hexdigest()
    stamp = f"{st.st_size}:{st.st_mtime_ns}:{header}"
    parts = [str(source), stamp, __version__, torch.__version__, str(CACHE_FORMAT), json.dumps(options, sort_keys=True)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32], stamp


# -- reading --------------------------------------------------------------------------------------------
def _read(entry: Path) -> tuple[nn.Module, Tokenizer] | None:
    """The entry's model and tokenizer, or None when it is missing or damaged (it is then rebuilt)."""
    if not verify_entry(entry):
        return None
    try:
        meta = json.loads((entry / "meta.json").read_text())
        watched = WatchedFile(entry / "model.pt")  # held open from before the mapping: it sees what changes
        tensors = torch.load(entry / "model.pt", mmap=True, weights_only=True)
        advise_huge_pages(tensors.values())  # streamed every decode step: huge pages where the kernel can
        model = _assemble(_config_from_json(meta["config"]), meta["dtype"], meta["max_positions"], tensors)
        restore_runtime(model, tensors, meta["runtime"])
        model.mapped_files = [watched]
        tokenizer = _tokenizer_from_json(meta["tokenizer"])
    except Exception:  # noqa: BLE001 - whole but unusable (another format): rebuild from the source
        remove_entry(entry)
        return None
    os.utime(entry)  # recency for eviction
    return model, tokenizer


def _assemble(config: ModelConfig, dtype: str, max_positions: int, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """A decoder whose every parameter and buffer is the saved tensor of that name (no copy).

    The skeleton is built on the meta device (no memory, no weight relayout); tensors that were one object
    when saved (tied embeddings) become one parameter again."""
    from kvcore.model.decoder import DecoderModel

    with torch.device("meta"):
        model = DecoderModel(config, getattr(torch, dtype.removeprefix("torch.")), max_positions)
    expected = {n for n, _ in model.named_parameters(remove_duplicate=False)} | {n for n, _ in model.named_buffers()}
    if not expected <= set(tensors):
        raise ValueError("cache entry does not match the decoder's parameters")
    shared: dict[int, nn.Parameter] = {}
    for name in expected:
        tensor = tensors[name]
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if attr in owner._buffers:
            owner._buffers[attr] = tensor
            continue
        # tied in the skeleton (the tied token table and LM head): one parameter again
        param = shared.setdefault(id(owner._parameters[attr]), nn.Parameter(tensor, requires_grad=False))
        owner._parameters[attr] = param
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise ValueError("cache entry left a tensor unset")
    return model


# -- writing --------------------------------------------------------------------------------------------
def _write(entry: Path, model: nn.Module, tokenizer: Tokenizer, info: dict[str, Any]) -> bool:
    """Save ``model`` and ``tokenizer`` as ``entry`` (atomically: a folder renamed into place); whether it was. A
    cache that cannot be written (read-only or full disk) is skipped with a warning: it only ever saves time; nor is
    a model holding a weight with no saved form (:func:`~kvcore.loaders.prepared.runtime_state`)."""
    with plain_pages():
        prepare_head(model, info["options"]["lm_head"])  # made now, where a later start would make it again
    runtime = runtime_state(model)
    if runtime is None:
        return False
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update({n: t for n, t in model.named_buffers()})
    tensors.update(runtime[0])
    meta = {
        "format": CACHE_FORMAT,
        # the file's config, window included (model.config reports the RoPE tables' length, "max_positions")
        "config": _config_to_json(dataclasses.replace(model.config, max_position_embeddings=model.context_window)),
        "dtype": str(model.dtype),
        "max_positions": model.config.max_position_embeddings,
        "tokenizer": _tokenizer_to_json(tokenizer),
        "runtime": runtime[1],
        **info,
    }

    def fill(folder: Path) -> None:
        # no zip CRC per record: it is a slow single-threaded pass over every byte, and the entry's own checksum
        # (kvcore.paths) already guards the file
        with serialization_config.patch({"save.compute_crc32": False}):
            torch.save({n: t.detach() for n, t in tensors.items()}, folder / "model.pt")
        (folder / "meta.json").write_text(json.dumps(meta))

    try:
        write_entry(entry.parent, entry.name, fill, checksums=False)
        _evict(entry, info["source"], info["stamp"])
    except OSError as exc:  # a full disk, a read-only folder
        warn_no_cache("model", entry.parent, exc)
        return False
    return True


def _evict(keep: Path, source: str, stamp: str) -> None:
    """Delete entries of older versions of ``source`` and the least recently used beyond MAX_ENTRIES. Only
    entries kvcore wrote count: any other folder there is the user's and is left alone."""
    entries = []
    for path in keep.parent.iterdir():
        if path == keep or path.name.startswith(".tmp-") or not is_entry(path):
            continue
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, ValueError):
            remove_entry(path)
            continue
        if meta.get("source") == source and meta.get("stamp") != stamp:
            remove_entry(path)
        else:
            entries.append((os.lstat(path).st_mtime, path))
    for _, path in sorted(entries)[: max(0, len(entries) + 1 - MAX_ENTRIES)]:
        remove_entry(path)


# -- config and tokenizer as JSON -----------------------------------------------------------------------
def _config_to_json(config: ModelConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def _tuples(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _config_from_json(fields: dict[str, Any]) -> ModelConfig:
    """Inverse of :func:`_config_to_json`: JSON lists back to the tuples the dataclasses hold."""
    fields = dict(fields)
    rope = fields.get("rope_scaling")
    if rope is not None:
        fields["rope_scaling"] = RopeScaling(**{k: _tuples(v) for k, v in rope.items()})
    if fields.get("sliding_window_layers") is not None:
        fields["sliding_window_layers"] = tuple(fields["sliding_window_layers"])
    return ModelConfig(**fields)


def _tokenizer_to_json(tok: Tokenizer) -> dict[str, Any]:
    return {
        "backend": tok.backend.to_str(),
        "bos_token_id": tok.bos_token_id,
        "eos_token_ids": list(tok.eos_token_ids),
        "pad_token_id": tok.pad_token_id,
        "add_bos": tok.add_bos,
        "chat_template": tok.chat_template,
        "recommended_sampling": tok.recommended_sampling,
    }


def _tokenizer_from_json(state: dict[str, Any]) -> Tokenizer:
    import tokenizers

    backend = tokenizers.Tokenizer.from_str(state.pop("backend"))
    return Tokenizer(backend, **state)
