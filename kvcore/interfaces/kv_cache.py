"""The KV-cache interface: where K and V rows are stored, in one *layout* that backends declare they read.

A cache is storage only. Which sequence owns which block, reference counts, copy-on-write and prefix
hashes belong to the core's :class:`~kvcore.scheduling.block_manager.BlockManager`; a cache is told where to write
(``meta.slot_mapping``) and which blocks to copy (:meth:`KVCache.copy_blocks`). Storage is allocated once
and written in place at each token's position; it is never grown with ``torch.cat``.

Every cache is addressed in blocks of ``block_size`` tokens. A *paged* layout lets the user choose the
block size (blocks are taken as a sequence grows); a per-sequence layout (``paged = False``) uses one
block of ``max_seq_len`` tokens per sequence: a slot reserved for the sequence's whole life.

Memory: ``2 × layers × kv_heads × head_dim × seq_len × bytes_per_element`` per sequence for a
full-precision cache; a quantized cache states its own :attr:`KVCache.bytes_per_token`.

Sliding windows: a layout that declares the window pool (``CacheCapabilities.no_window_pool`` is None) may be
given ``CacheSpec.layer_storage``: several layers then store their K/V in one *storage layer* (a block id
belongs to one group of layers at a time, :mod:`kvcore.scheduling.kv_groups`), and each layer reads its blocks
through the block tables of its group (``AttentionMetadata.for_layer``), where a block its window no longer
reads may be any block (the window masks its keys).
"""

from __future__ import annotations

import abc
import math
import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvcore.errors import ConfigError
from kvcore.interfaces.options import unknown_options_error

from .dtypes import dtype_name

if TYPE_CHECKING:
    from kvcore.interfaces.metadata import AttentionMetadata

__all__ = ["CacheSpec", "KVCache", "CacheCapabilities", "copy_block_rows", "placement_reasons", "zeros"]


def copy_block_rows(tensors: tuple[torch.Tensor, ...], pairs: list[tuple[int, int]]) -> None:
    """For each ``(src, dst)``, copy block ``src`` into block ``dst`` of every tensor (layers first, blocks
    second): the storage side of :meth:`KVCache.copy_blocks`, one indexed copy per tensor."""
    device = tensors[0].device
    src = torch.tensor([s for s, _ in pairs], device=device)
    dst = torch.tensor([d for _, d in pairs], device=device)
    for t in tensors:
        t[:, dst] = t[:, src]


def placement_reasons(
    devices: frozenset[str], dtypes: frozenset[torch.dtype], *, device: torch.device, dtype: torch.dtype
) -> list[str]:
    """Why ``device`` / ``dtype`` fall outside a plugin's declared ``devices`` / ``dtypes`` ([] = fine):
    the part every pluggable kind's capabilities share."""
    reasons = []
    if device.type not in devices:
        reasons.append(f"device '{device.type}' not supported (supports: {', '.join(sorted(devices))})")
    if dtype not in dtypes:
        names = ", ".join(sorted(dtype_name(d) for d in dtypes))
        reasons.append(f"dtype {dtype_name(dtype)} not supported (supports: {names})")
    return reasons


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(shape)`` for a cache's storage. On the CPU it is an anonymous mapping (zero pages the system
    backs only when first written), so a pool sized for every sequence a config allows costs memory only for
    the tokens it really holds; ``torch.zeros`` writes, and so makes resident, every byte up front."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=numel).view(shape)  # keeps the mapping alive

@dataclass(frozen=True)
class CacheSpec:
    """Sizes of a KV cache, from the model and the engine config."""

    num_layers: int  # L, decoder layers of the model
    num_kv_heads: int  # H_kv
    head_dim: int  # D
    dtype: torch.dtype  # the model's compute dtype (a quantized cache stores less, returns this)
    device: torch.device  # where the storage lives
    max_num_seqs: int  # sequences resident at the same time
    max_seq_len: int  # tokens per sequence (prompt + generated)
    block_size: int = 16  # paged layouts: tokens per block
    num_blocks: int | None = None  # paged layouts; None = enough for max_num_seqs × max_seq_len
    #: the storage layer of each model layer (layers of different groups share one; see the module
    #: docstring); None: layer ``l`` is storage layer ``l``
    layer_storage: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_num_seqs", "max_seq_len", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"cache: {name} must be a positive integer, got {value!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks <= 0):
            raise ConfigError(f"cache: num_blocks must be a positive integer, got {self.num_blocks!r}")
        rows = self.layer_storage
        if rows is not None and (len(rows) != self.num_layers or set(rows) != set(range(max(rows) + 1))):
            raise ConfigError(f"cache: layer_storage must name a storage layer 0..n-1 for each of the "
                              f"{self.num_layers} layers, every one used, got {rows!r}")

    @property
    def num_storage_layers(self) -> int:
        """Layers of storage a block id spans: ``num_layers`` unless ``layer_storage`` shares them."""
        return self.num_layers if self.layer_storage is None else max(self.layer_storage) + 1

    @property
    def element_size(self) -> int:
        """Bytes of one element of ``dtype`` (the model dtype, not necessarily what a lossy cache stores)."""
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class CacheCapabilities:
    """What a cache layout can store. ``kvcore plugins`` renders its table from these declarations."""

    devices: frozenset[str]  # torch device types
    dtypes: frozenset[torch.dtype]  # model dtypes it can hold (and hand back to attention)
    #: ``None`` for a lossless cache; else what is lost, e.g. "int8, one scale per token and KV head".
    #: The conformance suite holds a lossy cache to a tolerance derived from it.
    precision: str | None = None
    #: a lossy cache's largest relative rounding error of a stored element (int8 with a per-row absmax
    #: scale: 1/254 of the row's max; float16 storage: 2^-11), ``None`` = lossless. The conformance suite
    #: derives its tolerances from it.
    unit_roundoff: float | None = None
    #: why the layout cannot give the blocks a sliding-window layer no longer reads back to the pool (None: it
    #: can: it stores layers by ``CacheSpec.layer_storage`` and each layer reads its own group's block tables)
    no_window_pool: str | None = "not declared by the cache (CacheCapabilities.no_window_pool)"

    def reasons_unsupported(self, *, device: torch.device, dtype: torch.dtype) -> list[str]:
        return placement_reasons(self.devices, self.dtypes, device=device, dtype=dtype)


class KVCache(abc.ABC):
    """Per-layer K/V storage addressed by block id and offset.

    Subclass it, declare ``name``, ``layout``, ``paged`` and ``capabilities``, implement the abstract
    methods, and register the class through the ``kvcore_register_kv_caches`` hook. A backend reads the
    cache only through the layout it declares (``BackendCapabilities.kv_layouts``): ``layout`` names
    the contract between them, e.g. "contiguous" (``k``/``v`` tensors ``[L, slots, H_kv, S, D]``) or
    "paged" (:meth:`gather_blocks`).
    """

    name: ClassVar[str]  # what --kv-cache / kv_cache = "..." select it by
    #: the contract with the backends that read it: "contiguous" (``k``/``v`` ``[L, slots, H_kv, S, D]``) or
    #: "paged" (:meth:`gather_blocks`), or a layout of its own
    layout: ClassVar[str]
    capabilities: ClassVar[CacheCapabilities]  # its declarations (below)
    description: ClassVar[str] = ""  # one line for `kvcore plugins`
    #: True: blocks of ``spec.block_size`` tokens taken as sequences grow; False: one block of
    #: ``spec.max_seq_len`` tokens per sequence (a slot)
    paged: ClassVar[bool] = True

    def __init__(self, spec: CacheSpec, **options: Any) -> None:
        """``options`` come from the ``[kv_caches.<name>]`` table of the config file."""
        if options:
            raise unknown_options_error("KV cache", self.name, "kv_caches", type(self), options)
        if spec.layer_storage is not None and self.capabilities.no_window_pool is not None:
            raise ConfigError(f"KV cache '{self.name}' cannot share storage between layers: "
                              f"{self.capabilities.no_window_pool}")
        self.spec = spec
        self.block_size, self.num_blocks = self.geometry(spec)

    @classmethod
    def geometry(cls, spec: CacheSpec) -> tuple[int, int]:
        """``(block_size, num_blocks)`` this layout allocates for ``spec``."""
        if not cls.paged:
            return spec.max_seq_len, spec.max_num_seqs
        num_blocks = spec.num_blocks or math.ceil(spec.max_num_seqs * spec.max_seq_len / spec.block_size)
        return spec.block_size, num_blocks

    @classmethod
    def availability(cls) -> str | None:
        """``None`` when the cache can be used on this machine, else a one-line reason. Must not raise."""
        return None

    @abc.abstractmethod
    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store ``k``, ``v`` (``[T, H_kv, D]``, packed like ``meta``) at ``meta.slot_mapping``
        (``block_id * block_size + offset`` per token)."""

    @abc.abstractmethod
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy every layer's K/V of block ``src`` into block ``dst`` for each ``(src, dst)`` (copy-on-write)."""

    @abc.abstractmethod
    def read(self, layer_idx: int, block_table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first ``length`` tokens held by ``block_table``, each ``[length, H_kv, D]`` in the
        model dtype (a copy: tests, debugging, the conformance suite)."""

    def before_forward(self, meta: AttentionMetadata) -> None:
        """Called once per forward call (on every rank), before any layer writes or reads: where a layout whose
        readers may read rows past a sequence's length makes sure no such row holds another request's K/V (a
        NaN left there would poison the product even at softmax weight 0). Default: nothing."""
        return None  # a layout whose readers stay within each sequence's length needs nothing here

    @classmethod
    def token_bytes(cls, spec: CacheSpec) -> int:
        """Bytes one token's K and V occupy in one block id (across its storage layers: every layer unless
        ``layer_storage`` shares them) in this layout, before allocating anything (what capacity planning
        divides a memory budget by)."""
        return 2 * spec.num_storage_layers * spec.num_kv_heads * spec.head_dim * spec.element_size

    @property
    def bytes_per_token(self) -> int:
        return self.token_bytes(self.spec)

    @property
    @abc.abstractmethod
    def kv_bytes_allocated(self) -> int:
        """Bytes the cache's storage occupies."""
