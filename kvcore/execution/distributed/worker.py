"""Ranks 1..N-1: hold a model shard and a KV cache of the local heads, and run each step rank 0 sends.

A worker owns no scheduler, tokenizer or sampler. Messages (see :mod:`kvcore.execution.distributed.tp_runner`):

``("init", components)``   make the backends and the KV cache (``components`` from :class:`Components`)
``("step", step)``         a :class:`Step`: copy-on-write copies, then one forward (no logits)
``("stop", None)``         leave the loop

A worker that fails notes its error in the store for rank 0 (``error/<rank>``) and exits non-zero; its
closed sockets break rank 0's next collective at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvcore.execution.distributed.parallel_state import Endpoint, GroupFailure, RankGroup, set_note
from kvcore.execution.distributed.sharding import build_local_model
from kvcore.execution.runner import run_model
from kvcore.interfaces.kv_cache import CacheSpec
from kvcore.interfaces.metadata import AttentionMetadata
from kvcore.model.config import ModelConfig
from kvcore.model.decoder import LlamaModel

__all__ = ["Components", "Step", "serve", "spawned_worker_main", "rank_device"]


@dataclass(frozen=True)
class Components:
    """What rank 0 chose, by class (pickled by reference, so a plugin importable by name on every rank
    works, including ``package.module:Class`` backends); each rank constructs its own instances."""

    prefill_backend: tuple[type, dict]  # (class, constructor options)
    decode_backend: tuple[type, dict]
    kv_cache: tuple[type, CacheSpec, dict]  # (class, rank 0's spec; each rank puts its own device in)


@dataclass(frozen=True)
class Step:
    """One forward, as rank 0's block manager laid it out (the fields of AttentionMetadata.build)."""

    is_prefill: bool
    input_ids: list[int]  # [T] packed
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    block_size: int
    scale: float
    copies: list[tuple[int, int]]  # copy-on-write block copies (src, dst) made before this step
    #: with sliding-window layers giving blocks back: every group's block tables and each layer's group
    group_tables: list[list[list[int]]] | None = None
    layer_groups: tuple[int, ...] = ()

    @classmethod
    def of(cls, is_prefill: bool, input_ids: Sequence[int], meta: AttentionMetadata,
           copies: Sequence[tuple[int, int]]) -> Step:
        """The step rank 0 runs with ``meta``."""
        return cls(is_prefill, [int(t) for t in input_ids], list(meta.query_lens), list(meta.context_lens),
                   [list(t) for t in meta.block_tables], meta.block_size, meta.scale, [tuple(c) for c in copies],
                   [g.block_tables for g in meta.groups] if meta.groups else None, meta.layer_groups)


def rank_device(device: str | torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU for every rank, or the ``rank``-th GPU after the configured one
    (under torchrun: ``cuda:LOCAL_RANK``)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device
    if "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cuda", (device.index or 0) + rank)


def serve(group: RankGroup, model: LlamaModel, device: torch.device) -> None:
    """The worker loop: returns on ``stop``; raises :class:`GroupFailure` when rank 0 goes away."""
    kind, components = group.receive()
    if kind == "stop":
        return
    assert kind == "init", kind
    prefill_cls, prefill_opts = components.prefill_backend
    decode_cls, decode_opts = components.decode_backend
    prefill = prefill_cls(**prefill_opts)
    decode = prefill if (decode_cls, decode_opts) == (prefill_cls, prefill_opts) else decode_cls(**decode_opts)
    cache_cls, spec, cache_opts = components.kv_cache
    # Rank 0's spec with this rank's own KV heads (an uneven split gives ranks different counts) and device.
    local = dataclasses.replace(spec, device=device, num_kv_heads=model.config.num_key_value_heads)
    cache = cache_cls(local, **cache_opts)
    group.note(f"ready/{group.rank}", {
        "pid": os.getpid(),
        "device": str(device),
        "num_blocks": cache.num_blocks,
        "kv_bytes_per_token": cache.bytes_per_token,
        "kv_bytes_allocated": cache.kv_bytes_allocated,
    })
    with torch.inference_mode():
        while True:
            kind, step = group.receive()
            if kind == "stop":
                return
            if step.copies:
                cache.copy_blocks(step.copies)
            meta = AttentionMetadata.build(
                step.query_lens, step.context_lens, step.block_tables, step.block_size, step.scale, device,
                model.attention_layers,
            )
            if step.group_tables is not None:
                meta = meta.with_groups(step.group_tables, step.layer_groups)
            run_model(model, prefill if step.is_prefill else decode, cache, meta, step.input_ids)


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this worker when rank 0's process ends, however it ends (even SIGKILL)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # rank 0 died before the line above took effect
        os._exit(1)


def spawned_worker_main(
    index: int,
    endpoint: Endpoint,
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    device: str,
    num_threads: int,
    parent_pid: int,
) -> None:
    """Entry point of a worker kvcore spawned (``torch.multiprocessing``, start method spawn): rank
    ``index + 1``. ``state`` is its shard, passed through shared memory."""
    rank = index + 1
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to rank 0, which stops the workers
    if num_threads:
        torch.set_num_threads(num_threads)
    store, _ = RankGroup.open_store(endpoint, rank)
    make = lambda group: build_local_model(config, state, group.all_reduce, device)  # noqa: E731
    sys.exit(run_worker(rank, endpoint, store, make, torch.device(device)))


def run_worker(rank: int, endpoint: Endpoint, store: dist.Store, make_model: Callable[[RankGroup], LlamaModel],
               device: torch.device) -> int:
    """Join the group, build the shard (``make_model(group)``) and serve; on failure note the error for
    rank 0 and return 1 (0 after a clean stop)."""
    try:
        set_note(store, f"hello/{rank}", os.getpid())
        group = RankGroup.connect(endpoint, rank, store)
        model = make_model(group)
        serve(group, model, device)
        return 0
    except GroupFailure:
        return 1  # rank 0 is gone or broke the group: nothing to report to
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then this process exits
        with contextlib.suppress(Exception):
            set_note(store, f"error/{rank}", f"{type(exc).__name__}: {exc}")
        if os.environ.get("KVCORE_DEBUG") == "1":  # rank 0's one error line carries the message
            traceback.print_exc(file=sys.stderr)
        return 1
    finally:
        sys.stderr.flush()
