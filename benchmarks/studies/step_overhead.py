"""How much of a decode step is kernels, small ATen ops, and Python: the step against a replay of its own ops.

One decode step's every operator call (kvcore's C++ kernels and ATen's ops, with their arguments) is recorded
through a ``TorchDispatchMode``; the same calls are then replayed back to back with nothing between them, and
the kernels alone (``kvcore::`` and the GEMMs). Steps and replays alternate in one process, so a shared machine
slows them alike:

* ``step - all ops`` is the Python around the ops (engine, scheduler, model code, op dispatch from Python);
* ``all ops - kernels`` is the small ATen ops (metadata, views, casts, checks);
* ``kernels`` is the floor a step cannot go below without faster kernels.

    python benchmarks/studies/step_overhead.py                  # kvcore's default configuration, 1 thread
    python benchmarks/studies/step_overhead.py --threads 2 --reps 40
    python benchmarks/studies/step_overhead.py --ops             # also list the recorded ops (name, count)
    python benchmarks/studies/step_overhead.py --stack --context 1024  # also the step with and without the native stack

With ``--threads 1`` (the default) the figures are this thread's CPU time, which stays meaningful on a busy
machine; with more threads they are wall times.

``--stack`` also times whole steps with the fused layers' native decode stack (``cpu_decode``'s
``native_stack``, csrc/decode_stack.cpp) against every layer through the backend's forward, the two alternating
step by step (so each pair decodes at about the same context).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvcore import Engine, EngineConfig, SamplingParams

_GEMMS = ("aten.mm", "aten.addmm", "aten.bmm", "mkldnn._linear_pointwise", "aten._weight_int4pack_mm_for_cpu")


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def _is_kernel(func) -> bool:
    name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
    return name.startswith("kvcore.") or name in _GEMMS


def _replay(calls) -> None:
    for func, args, kwargs in calls:
        func(*args, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30, help="steps (and replays of each kind) measured")
    ap.add_argument("--ops", action="store_true", help="list the recorded ops")
    ap.add_argument("--stack", action="store_true", help="also steps with the native decode stack against without")
    ap.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an EngineConfig field beyond the defaults (e.g. compile=true)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    options = {}
    for item in args.engine_option:
        key, value = item.split("=", 1)
        options[key] = {"true": True, "false": False}.get(value.lower(), value)
    engine = Engine.from_pretrained("smollm2", EngineConfig(
        max_num_seqs=args.batch, max_model_len=args.context + 4 * args.reps + 64, **options))
    prompts = [[(7 * i + 13 * b) % 40000 + 100 for i in range(args.context)] for b in range(args.batch)]
    engine.generate([p[:32] for p in prompts], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=4 * args.reps + 32, ignore_eos=True))
    for _ in range(4):  # the prefill, then a few decode steps
        engine.step()
    recorder = _Recorder()
    with torch.inference_mode(), recorder:
        engine.step()
    calls = recorder.calls
    kernels = [c for c in calls if _is_kernel(c[0])]
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    times: dict[str, list[float]] = {"step": [], "all ops": [], "kernels": []}
    with torch.inference_mode():
        for _ in range(3):
            _replay(calls)
        for _ in range(args.reps):
            for name, fn in (("step", engine.step), ("all ops", lambda: _replay(calls)),
                             ("kernels", lambda: _replay(kernels))):
                start = clock()
                fn()
                times[name].append(clock() - start)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    config = engine.config
    print(f"{config.backend} {config.dtype} {config.weights} weights, {config.lm_head} head, compile "
          f"{config.compile}, batch {args.batch}, context {args.context}, {torch.get_num_threads()} threads, "
          f"{'thread CPU' if clock is time.thread_time else 'wall'} time, medians of {args.reps}:")
    print(f"  step {med['step']:.2f} ms = kernels {med['kernels']:.2f} ({len(kernels)} calls) + small ATen ops "
          f"{med['all ops'] - med['kernels']:.2f} ({len(calls) - len(kernels)} calls) + Python "
          f"{med['step'] - med['all ops']:.2f} ms")
    if args.stack:
        _compare_stack(engine, clock, args.reps)
    if args.ops:
        counts = collections.Counter(str(c[0]) for c in calls)
        for name, n in counts.most_common():
            print(f"  {n:4d} {name}")


def _compare_stack(engine: Engine, clock, reps: int) -> None:
    """Steps with the decode backend's native stack on and off, alternating; prints both medians and their ratio."""
    backend = engine.decode_backend
    if not hasattr(backend, "native_stack"):
        print(f"  --stack: backend '{backend.name}' has no native decode stack")
        return
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        with torch.inference_mode():
            for _ in range(reps):
                for native in (True, False):
                    backend.native_stack = native
                    start = clock()
                    engine.step()
                    times[native].append(clock() - start)
    finally:
        backend.native_stack = True
    on, off = (statistics.median(times[k]) * 1e3 for k in (True, False))
    print(f"  native stack: step {on:.2f} ms (min {min(times[True]) * 1e3:.2f}); per-layer: {off:.2f} ms "
          f"(min {min(times[False]) * 1e3:.2f}); per-layer / stack {off / on:.2f}x")


if __name__ == "__main__":
    main()
