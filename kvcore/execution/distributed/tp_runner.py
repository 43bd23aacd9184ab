"""Rank 0's side of tensor parallelism: start the other ranks, send each step, run the local shard.

The :class:`~kvcore.engine.core.Engine` keeps the scheduler, block manager, tokenizer and sampler on rank 0
and hands each forward to :meth:`TensorParallelRunner.forward`, which broadcasts the batch (token ids,
query/context lengths, block tables, copy-on-write copies) and then runs rank 0's shard; every rank
addresses its own KV cache (its local heads only) with the same block ids. Rank 0 computes the logits
with the replicated LM head.

Launch: by default the runner spawns ranks 1..N-1 itself (``torch.multiprocessing``, start method
spawn), passing each its weight shard through shared memory. Under ``torchrun`` (``RANK``/``WORLD_SIZE``
in the environment, ``WORLD_SIZE == tensor_parallel_size``) every process builds the engine: rank 0
becomes the engine, any other rank serves as a worker inside this constructor and then ends its process
(``SystemExit`` with 0 after rank 0 stops it, 1 after a failure).

Failure: any broken collective, a worker that exits, or a collective slower than ``KVCORE_TP_TIMEOUT_S``
tears the whole group down (workers killed and reaped) and raises one
:class:`~kvcore.errors.TensorParallelError` naming the rank and the cause; every later call raises it again.
"""

from __future__ import annotations

import os
import signal
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from kvcore.errors import ConfigError, TensorParallelError
from kvcore.execution.distributed.parallel_state import (
    Endpoint,
    GroupFailure,
    RankGroup,
    collective_timeout,
    read_note,
    startup_timeout,
    torchrun_rank,
)
from kvcore.execution.distributed.sharding import build_local_model, local_config, plan_shards, shard_state
from kvcore.execution.distributed.worker import Components, Step, rank_device, run_worker, spawned_worker_main
from kvcore.execution.runner import RunConfig, last_token_logits, position_logits
from kvcore.interfaces.attention import AttentionBackend
from kvcore.interfaces.kv_cache import KVCache
from kvcore.interfaces.metadata import AttentionMetadata
from kvcore.model.decoder import LlamaModel

__all__ = ["TensorParallelRunner"]


class _Group:
    """The worker processes and the group, apart from the runner so a finalizer can stop them."""

    def __init__(self) -> None:
        self.procs: list[Any] = []  # spawned workers (empty under torchrun)
        self.restore_threads = 0  # rank 0's intra-op thread count before the group took its share
        self.group: RankGroup | None = None
        self.store: dist.Store | None = None
        self.closed = False

    def shutdown(self, graceful: bool) -> None:
        if self.closed:
            return
        self.closed = True
        if graceful and self.group is not None:
            try:
                self.group.send(("stop", None))
            except GroupFailure:
                graceful = False
        if not graceful and self.group is not None:
            self.group.abort()
        for p in self.procs:
            p.join(timeout=10 if graceful else 0)
            if p.is_alive():
                p.kill()  # SIGKILL: also ends a stopped (SIGSTOP) or hung worker
                p.join(timeout=10)
        self.group = None
        if self.restore_threads:
            torch.set_num_threads(self.restore_threads)


class TensorParallelRunner:
    """Rank 0 of a tensor-parallel group of ``config.tensor_parallel_size`` ranks.

    ``model`` is the full model; :attr:`model` is rank 0's shard (the engine sizes its backends and KV
    cache from its config). Call :meth:`start` once the backends and rank 0's cache exist.
    """

    def __init__(self, model: LlamaModel, config: RunConfig) -> None:
        n = config.tensor_parallel_size
        self.world_size = n
        self.shards = plan_shards(model.config, n)
        device = torch.device(config.device)
        self.launcher = "spawn"
        endpoint = Endpoint("tcp", n, device_type=device.type)
        under_torchrun = torchrun_rank()
        if under_torchrun is not None:
            rank, world = under_torchrun
            if world != n:
                raise ConfigError(f"torchrun started {world} processes but tensor_parallel_size is {n}; "
                                  "start one process per rank (torchrun --nproc-per-node N)")
            self.launcher, endpoint = "torchrun", Endpoint("env", n, device_type=device.type)
            if rank != 0:
                raise SystemExit(self._serve_as_worker(model, config, rank, endpoint))
        elif device.type == "cuda" and (device.index or 0) + n > torch.cuda.device_count():
            raise ConfigError(f"tensor_parallel_size {n} from {device} needs {n} GPUs; "
                              f"{torch.cuda.device_count()} are visible")
        self._state = _Group()
        self._finalizer = weakref.finalize(self, self._state.shutdown, True)
        self._broken: str | None = None
        self.ranks: list[dict] = []
        try:
            self._state.store, endpoint = RankGroup.open_store(endpoint, 0)
            if self.launcher == "spawn":
                self._spawn(model, config, endpoint)
            self._await_notes("hello", "start")
            self._state.group = RankGroup.connect(endpoint, 0, self._state.store)
        except GroupFailure as exc:
            self._fail(str(exc))
        self.model = build_local_model(local_config(model.config, self.shards[0]), shard_state(
            model, self.shards[0], with_lm_head=True), self._state.group.all_reduce, device)

    # -- start-up ------------------------------------------------------------------------------------
    def _spawn(self, model: LlamaModel, config: RunConfig, endpoint: Endpoint) -> None:
        import torch.multiprocessing as mp  # registers the shared-memory pickling of tensors

        ctx = mp.get_context("spawn")
        # One process per rank on a shared CPU: split the cores so the ranks do not oversubscribe them
        # (rank 0 included, until close(): ranks whose spinning OpenMP threads outnumber the cores slow
        # every collective down, since each waits for the slowest rank).
        threads = max(1, (os.cpu_count() or 1) // self.world_size) if endpoint.device_type == "cpu" else 0
        if threads and torch.get_num_threads() > threads:
            self._state.restore_threads = torch.get_num_threads()
            torch.set_num_threads(threads)
        for shard in self.shards[1:]:
            state = {k: v.cpu() for k, v in shard_state(model, shard, with_lm_head=False).items()}
            args = (shard.rank - 1, endpoint, local_config(model.config, shard), state,
                    str(rank_device(config.device, shard.rank)), threads, os.getpid())
            proc = ctx.Process(target=spawned_worker_main, args=args, name=f"kvcore-tp-rank{shard.rank}", daemon=True)
            proc.start()
            self._state.procs.append(proc)

    @staticmethod
    def _serve_as_worker(model: LlamaModel, config: RunConfig, rank: int, endpoint: Endpoint) -> int:
        device = rank_device(config.device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        shard = plan_shards(model.config, endpoint.world_size)[rank]
        store, _ = RankGroup.open_store(endpoint, rank)

        def make(group: RankGroup) -> LlamaModel:
            state = shard_state(model, shard, with_lm_head=False)
            return build_local_model(local_config(model.config, shard), state, group.all_reduce, device)

        return run_worker(rank, endpoint, store, make, device)

    def _await_notes(self, key: str, what: str) -> list[Any]:
        """Wait until every other rank has noted ``key/<rank>`` (checking that none died meanwhile)."""
        limit = startup_timeout()
        deadline = time.monotonic() + limit
        notes: dict[int, Any] = {}
        while len(notes) < self.world_size - 1:
            for r in range(1, self.world_size):
                if r not in notes:
                    value = read_note(self._state.store, f"{key}/{r}")
                    if value is not None:
                        notes[r] = value
            self._check_workers()
            if len(notes) < self.world_size - 1:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, self.world_size)) - set(notes))
                    self._fail(f"rank(s) {missing} did not {what} within {limit:g} s (KVCORE_TP_STARTUP_TIMEOUT_S)")
                time.sleep(0.01)
        return [notes[r] for r in range(1, self.world_size)]

    def start(self, prefill_backend: AttentionBackend, decode_backend: AttentionBackend, cache: KVCache,
              config: RunConfig) -> None:
        """Have every rank make the same backends and a KV cache like ``cache`` over its local heads."""
        backend_options, cache_options = config.backend_options, config.kv_cache_options
        components = Components((type(prefill_backend), dict(backend_options.get(prefill_backend.name) or {})),
                                (type(decode_backend), dict(backend_options.get(decode_backend.name) or {})),
                                (type(cache), cache.spec, dict(cache_options.get(cache.name) or {})))
        self._send(("init", components))
        ready = self._await_notes("ready", "allocate its KV cache")
        rank0 = {"pid": os.getpid(), "device": str(cache.spec.device), "num_blocks": cache.num_blocks,
                 "kv_bytes_per_token": cache.bytes_per_token, "kv_bytes_allocated": cache.kv_bytes_allocated}
        self.ranks = [{**shard.as_dict(), **info} for shard, info in zip(self.shards, [rank0, *ready])]
        blocks = {r["num_blocks"] for r in self.ranks}
        if len(blocks) != 1:
            self._fail(f"the ranks' KV caches hold different numbers of blocks ({sorted(blocks)})")

    # -- one step ------------------------------------------------------------------------------------
    def forward(self, is_prefill: bool, backend: AttentionBackend, cache: KVCache, meta: AttentionMetadata,
                input_ids: Sequence[int], copies: Sequence[tuple[int, int]] = (), rows: Sequence[int] | None = None
                ) -> torch.Tensor:
        """Run one step on every rank; ``[B, V]`` float32 logits of each sequence's last token (rank 0), or of
        the sequences ``rows`` only."""
        return self._step(Step.of(is_prefill, input_ids, meta, copies),
                          lambda ids: last_token_logits(self.model, backend, cache, meta, ids, rows))

    def forward_positions(self, backend: AttentionBackend, cache: KVCache, meta: AttentionMetadata,
                          input_ids: Sequence[int], rows: Sequence[int], num_positions: Sequence[int],
                          copies: Sequence[tuple[int, int]] = ()) -> torch.Tensor:
        """Run one decode step on every rank; rank 0's logits of several positions per row (:func:`position_logits`)."""
        return self._step(Step.of(False, input_ids, meta, copies),
                          lambda ids: position_logits(self.model, backend, cache, meta, ids, rows, num_positions))

    def _step(self, step: Step, logits_of: Callable[[list[int]], torch.Tensor]) -> torch.Tensor:
        """Send ``step`` to the other ranks, run it here, and return ``logits_of`` its token ids (rank 0)."""
        self._check_workers()
        self._send(("step", step))
        try:
            logits = logits_of(step.input_ids)
            if logits.is_cuda:
                self._await_device(logits.device)
            return logits
        except GroupFailure as exc:
            self._fail(str(exc))
        except Exception as exc:  # the other ranks are mid-step, waiting on rank 0: the group cannot go on
            self._fail(f"rank 0 failed mid-step: {type(exc).__name__}: {exc}")
        except BaseException:  # Ctrl-C mid-step: the workers wait in a collective; stop them now, not at exit
            self._broken = "tensor-parallel group was interrupted mid-step and shut down"
            self._state.shutdown(graceful=False)
            raise

    def _await_device(self, device: torch.device) -> None:
        """NCCL all-reduces are queued on the GPU: a dead or hung peer would leave the first host read of the
        logits blocked for good. Wait for the step's GPU work here instead, watching the workers and the
        collective timeout."""
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        deadline = time.monotonic() + collective_timeout()
        while not done.query():
            self._check_workers()
            if time.monotonic() > deadline:
                raise GroupFailure(f"a step's GPU collectives timed out after {collective_timeout():g} s")
            time.sleep(0.0002)

    def _send(self, message: object) -> None:
        if self._broken:
            raise TensorParallelError(self._broken)
        try:
            self._state.group.send(message)
        except GroupFailure as exc:
            self._fail(str(exc))

    # -- failure and shutdown --------------------------------------------------------------------------
    def _check_workers(self) -> None:
        if self._broken:
            raise TensorParallelError(self._broken)
        if any(p.exitcode is not None for p in self._state.procs):
            self._fail("a worker process ended")

    def failure(self) -> str | None:
        """Why the group cannot serve (it failed, or a worker process has ended), or None. Reads process
        states only: safe to call from another thread (a health check) while a step runs."""
        if self._broken:
            return self._broken
        for rank, p in enumerate(self._state.procs, start=1):
            if p.exitcode is not None:
                return f"tensor-parallel rank {rank} (pid {p.pid}) has ended (exit code {p.exitcode})"
        return None

    def _fail(self, cause: str) -> None:
        """Tear the group down and raise one TensorParallelError (what died or hung, and how)."""
        # A peer's closed socket usually means it died a moment ago: wait for its exit to name the rank and signal
        deadline = time.monotonic() + 2.0
        while self._state.procs and all(p.exitcode is None for p in self._state.procs) and time.monotonic() < deadline:
            time.sleep(0.02)
        dead = []
        for rank, p in enumerate(self._state.procs, start=1):
            error = read_note(self._state.store, f"error/{rank}") if self._state.store is not None else None
            if error:  # it is on its way out: its sockets close before a loaded machine has torn its interpreter down
                p.join(collective_timeout())
            if p.exitcode is None:
                continue
            code = p.exitcode
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            dead.append(f"rank {rank} (pid {p.pid}) {how}" + (f" after {error}" if error else ""))
        if dead:
            cause = "; ".join(dead)
        elif "Timed out" in cause or "timed out" in cause:
            cause += f" (a rank did not answer within KVCORE_TP_TIMEOUT_S={collective_timeout():g} s)"
        self._broken = f"tensor-parallel group failed: {cause}; all {self.world_size} ranks were shut down"
        self._state.shutdown(graceful=False)
        self._finalizer.detach()
        raise TensorParallelError(self._broken)

    def close(self) -> None:
        """Stop the other ranks (idempotent; also runs when the runner is garbage-collected or at exit)."""
        self._finalizer()

    def describe(self) -> dict:
        """The group for reports: launcher, collective backend, and per rank its heads, FFN slice, pid,
        device and KV-cache bytes (per token and allocated)."""
        device_type = torch.device(self.ranks[0]["device"]).type if self.ranks else "cpu"
        return {"size": self.world_size, "launcher": self.launcher,
                "collectives": "nccl" if device_type == "cuda" else "gloo", "ranks": self.ranks}
