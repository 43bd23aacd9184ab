"""The tensor-parallel process group: who is who, the two channels between ranks, and their timeouts.

Every rank holds two groups over one ``TCPStore``:

``commands`` (gloo, CPU)
    Rank 0 broadcasts each step's batch to the other ranks as a pickled message (an ``int64`` length,
    then the bytes). The other ranks wait on it for as long as rank 0 is alive, because an idle engine
    (a server with no requests) is not a hung one; rank 0 dying closes its sockets, which ends the wait
    at once.
``compute`` (gloo on CPU, NCCL on CUDA)
    The all-reduce (sum) after every row-parallel layer, under :func:`collective_timeout`: a rank that
    dies breaks the collective at once (closed socket), a rank that hangs breaks it after the timeout.

Failures surface as :class:`GroupFailure`, which the rank-0 runner turns into one
:class:`~kvcore.errors.TensorParallelError` after tearing the group down.
"""

from __future__ import annotations

import datetime
import os
import pickle
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Endpoint",
    "GroupFailure",
    "RankGroup",
    "collective_timeout",
    "startup_timeout",
    "torchrun_rank",
]

#: how long a worker may wait for the next command: rank 0 may stay idle indefinitely (see module doc)
IDLE_WAIT = datetime.timedelta(days=30)


class GroupFailure(RuntimeError):
    """A collective or the store failed (a peer died, hung past the timeout, or closed the group)."""


def _seconds_from_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        from kvcore.errors import ConfigError

        raise ConfigError(f"{name} must be a positive number of seconds, got '{raw}'")
    return value


def collective_timeout() -> float:
    """Seconds one collective (an all-reduce, a command send) may take before its rank counts as hung:
    ``KVCORE_TP_TIMEOUT_S``, default 120 (a slow first prefill on a loaded CPU stays well under it)."""
    return _seconds_from_env("KVCORE_TP_TIMEOUT_S", 120.0)


def startup_timeout() -> float:
    """Seconds the ranks may take to start and meet (spawn, import torch, load the shard):
    ``KVCORE_TP_STARTUP_TIMEOUT_S``, default 300."""
    return _seconds_from_env("KVCORE_TP_STARTUP_TIMEOUT_S", 300.0)


def torchrun_rank() -> tuple[int, int] | None:
    """``(rank, world_size)`` when this process was started by ``torchrun`` (its environment), else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return None
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None


@dataclass(frozen=True)
class Endpoint:
    """Where the ranks meet: ``tcp`` (kvcore spawned the workers; rank 0 hosts the store on ``port``) or
    ``env`` (torchrun: ``MASTER_ADDR``/``MASTER_PORT`` and its agent's store)."""

    kind: str  # "tcp" | "env"
    world_size: int
    host: str = "127.0.0.1"
    port: int = 0
    device_type: str = "cpu"  # "cpu" → gloo all-reduce, "cuda" → NCCL


def _gloo(store: dist.Store, prefix: str, rank: int, size: int, timeout: datetime.timedelta, host: str | None):
    opts = dist.ProcessGroupGloo._Options()
    # Connecting waits for every peer to arrive, which takes as long as the slowest start; the per-op
    # timeout is set once all are connected.
    opts._timeout = datetime.timedelta(seconds=startup_timeout())
    gloo = dist.ProcessGroupGloo
    opts._devices = [gloo.create_device(hostname=host) if host else gloo.create_default_device()]
    pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, opts)
    pg.set_timeout(timeout)
    return pg


def _nccl(store: dist.Store, prefix: str, rank: int, size: int, timeout: datetime.timedelta):
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, size, opts)


#: the backends of every group this process aborted (see :meth:`RankGroup.abort`)
_ABORTED: list = []


class RankGroup:
    """This rank's handle on the group. Build it with :meth:`connect`."""

    def __init__(self, rank: int, endpoint: Endpoint, store: dist.Store, commands, compute) -> None:
        self.rank, self.world_size, self.endpoint = rank, endpoint.world_size, endpoint
        self.store, self._commands, self._compute = store, commands, compute

    @classmethod
    def open_store(cls, endpoint: Endpoint, rank: int) -> tuple[dist.Store, Endpoint]:
        """The store every rank meets on; for a ``tcp`` endpoint rank 0 hosts it (port 0 = a free port,
        returned in the endpoint)."""
        timeout = datetime.timedelta(seconds=startup_timeout())
        if endpoint.kind == "env":
            store, _, _ = next(dist.rendezvous("env://", rank, endpoint.world_size, timeout=timeout))
            return store, endpoint
        if rank == 0:
            store = dist.TCPStore(endpoint.host, endpoint.port, endpoint.world_size, True, timeout=timeout,
                                  wait_for_workers=False)
            return store, Endpoint("tcp", endpoint.world_size, endpoint.host, store.port, endpoint.device_type)
        return dist.TCPStore(endpoint.host, endpoint.port, endpoint.world_size, False, timeout=timeout), endpoint

    @classmethod
    def connect(cls, endpoint: Endpoint, rank: int, store: dist.Store) -> RankGroup:
        """Join both groups (blocks until every rank has joined)."""
        size = endpoint.world_size
        timeout = datetime.timedelta(seconds=collective_timeout())
        host = endpoint.host if endpoint.kind == "tcp" else None
        wait = timeout if rank == 0 else IDLE_WAIT
        try:
            commands = _gloo(store, "kvcore/commands", rank, size, wait, host)
            if endpoint.device_type == "cuda":
                compute = _nccl(store, "kvcore/compute", rank, size, timeout)
            else:
                compute = _gloo(store, "kvcore/compute", rank, size, timeout, host)
        except RuntimeError as exc:
            raise GroupFailure(f"rank {rank} could not join the group: {_first_line(exc)}") from exc
        return cls(rank, endpoint, store, commands, compute)

    # -- the compute channel ---------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (every rank gets the same values); returns ``x``."""
        try:
            self._compute.allreduce([x]).wait()
        except RuntimeError as exc:
            raise GroupFailure(f"all-reduce failed on rank {self.rank}: {_first_line(exc)}") from exc
        return x

    def abort(self) -> None:
        """Abandon both groups after a failure (NCCL: frees communicators stuck on a dead peer)."""
        for pg in (self._compute, self._commands):
            try:
                pg.abort()
            except (RuntimeError, AttributeError):
                pass
        # An aborted gloo group's threads can still be joinable; destroying the group then calls std::terminate.
        # Kept until the process ends (the CLI ends it with os._exit: TensorParallelError.end_process).
        _ABORTED.extend((self._compute, self._commands))

    # -- the command channel ---------------------------------------------------------------------------
    def send(self, message: object) -> None:
        """Rank 0: broadcast ``message`` (any picklable object) to every other rank."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._broadcast(torch.tensor([len(payload)], dtype=torch.int64))
        self._broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    def receive(self) -> Any:
        """Other ranks: the next message from rank 0 (waits while rank 0 is alive)."""
        size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(payload)
        return pickle.loads(payload.numpy().tobytes())

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            self._commands.broadcast([t], opts).wait()
        except RuntimeError as exc:
            raise GroupFailure(f"command broadcast failed on rank {self.rank}: {_first_line(exc)}") from exc

    # -- the store (out-of-band notes: readiness, a worker's last error) --------------------------------
    def note(self, key: str, value: object) -> None:
        set_note(self.store, key, value)

    def read_note(self, key: str) -> Any | None:
        return read_note(self.store, key)


def read_note(store: dist.Store, key: str) -> Any | None:
    """A note set by :meth:`RankGroup.note`, or None (also when the store is gone)."""
    full = f"kvcore/note/{key}"
    try:
        if not store.check([full]):
            return None
        return pickle.loads(store.get(full))
    except (RuntimeError, pickle.UnpicklingError):
        return None


def set_note(store: dist.Store, key: str, value: object) -> None:
    store.set(f"kvcore/note/{key}", pickle.dumps(value))


def _first_line(exc: BaseException) -> str:
    """The message's first line without gloo's ``[source/file.cc:NN]`` prefix."""
    text = str(exc).strip().splitlines()
    if not text:
        return type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", text[0]).split(" This is typically caused")[0]
