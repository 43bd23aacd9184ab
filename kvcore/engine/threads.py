"""How many torch CPU threads a run uses: one code path for the CLI (``--threads``, ``threads =``) and the
Python API (``Engine.from_settings``)."""

from __future__ import annotations

import os
import time

from kvcore.errors import ConfigError

__all__ = ["apply_threads", "default_threads", "busy_cpus"]


def default_threads() -> int:
    """The cores this process may run on (its CPU affinity) minus those other work keeps busy right now, at
    least 1. On a shared machine, more compute threads than free cores make each step wait for the slowest,
    descheduled thread. "Right now" is the kernel's run queue (:func:`busy_cpus`), not the load average: that
    decays over minutes and would still count a job that has just ended."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - busy_cpus())


#: run-queue samples :func:`busy_cpus` takes, and the pause between them (seconds)
_SAMPLES, _SAMPLE_PAUSE = 5, 0.01


def busy_cpus() -> int:
    """How many CPUs other processes' threads are running on: the median of a few readings of the running
    task count in ``/proc/loadavg`` (this process's own thread excluded). Where there is no such file, the
    1-minute load average, rounded; 0 where neither exists."""
    counts = []
    for i in range(_SAMPLES):
        try:
            with open("/proc/loadavg", encoding="ascii") as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)  # "1.2 0.9 0.7 3/412 1234"
        except (OSError, IndexError, ValueError):
            break
        if i + 1 < _SAMPLES:
            time.sleep(_SAMPLE_PAUSE)
    if counts:
        return max(0, sorted(counts)[len(counts) // 2])
    try:
        return int(os.getloadavg()[0] + 0.5)
    except (AttributeError, OSError):
        return 0


def apply_threads(threads: int | None, *, choose: bool = True) -> int:
    """Set torch's intra-op threads: ``threads`` when given (checked: a ConfigError naming the range), else
    OMP_NUM_THREADS when set (torch reads it), else :func:`default_threads` when ``choose``. Returns the count
    in use.

    The CLI owns its process and chooses (``choose=True``); ``Engine.from_settings`` passes ``choose=False``:
    a library that changed torch's process-wide thread count unasked would override what the host program set
    (or torch's own default of every core), so with ``threads`` unset the API leaves torch alone."""
    import torch

    if threads is not None:
        # far more threads than cores only slows every step, and OpenMP allocates per thread up front (a
        # billion threads aborts the process in libgomp before Python can report anything)
        limit = max(64, 4 * (os.cpu_count() or 1))
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= limit:
            raise ConfigError(
                f"threads must be an integer from 1 to {limit} (4 × the CPU count, or 64), got {threads!r}")
        torch.set_num_threads(threads)
    elif choose and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(default_threads())
    return torch.get_num_threads()
