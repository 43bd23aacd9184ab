"""``kvcore bench``: latency, throughput and memory of kvcore's backends, side by side with transformers.

Everything runs through the serving API (:meth:`Engine.add_request` + :meth:`Engine.step`), greedy,
``ignore_eos`` (every request generates exactly its token budget). When transformers is installed the
same dequantized weights are loaded into its ``LlamaForCausalLM`` (sdpa attention, same dtype) and every
measured kvcore run alternates with a transformers run in the same process; figures are medians of the
repetitions. Cases (``--cases``):

``decode``    decode tokens/s, float32, batch 1, 64-token prompt
``long``      decode tokens/s at a 2048-token context, and time to first token of that 2048-token prompt
``bf16``      decode tokens/s, bfloat16, batch 1, 64-token prompt
``batch``     aggregate decode tokens/s of 8 concurrent requests with ragged prompt lengths
``capacity``  how many mixed-length requests run concurrently under one fixed KV-cache byte budget:
              the paged cache (blocks taken as sequences grow) vs the contiguous cache (``max_model_len``
              reserved per slot); counted from the real engine and caches, not from a formula
``scaling``   decode step time vs context length (64 ... 4096), one line per backend (PNG plot)
``chunked``   the worst inter-token gap of 4 running requests while a 2048-token prompt is admitted, with
              chunked prefill (128-token budget per step) vs whole-prompt prefill, and that prompt's TTFT
``speculative`` batch-1 decode tokens/s with n-gram speculation vs without, on an input-grounded prompt (a
              random token sequence given twice and a half: the model copies it), with the acceptance rate,
              drafts kept per verification step and tokens per decode step

Definitions: TTFT = request arrival to its first token; TPOT = mean time per output token after the
first; decode tokens/s = tokens after the first / time after the first token (summed over the batch
for ``batch``); peak RSS = the process's resident-set high-water mark during the run (Linux; both
models stay resident, so it is a process figure); KV bytes = the cache's allocation and its peak use.

Writes ``results.md`` (target table + per-backend details), ``results.json`` and
``decode_step_vs_context.png`` to ``--out`` (default ``bench-out/``).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvcore_bench import cases
from kvcore_bench import cli as _cli
from kvcore_bench.common import environment, load_average
from kvcore_bench.harness import Harness
from kvcore_bench.report import evaluate_targets, render_target_table, write_outputs
from kvcore_bench.settings import BenchSettings, settings_from_args

__all__ = ["Bench", "add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """The ``bench`` subcommand (declared in :mod:`kvcore_bench.cli`) running :func:`run`."""
    return _cli.add_parser(subparsers, run)


def run(args: argparse.Namespace) -> int:
    """``kvcore bench``: the backend comparison, or the mode a flag names (``--real-size``, ``--scale``,
    ``--llamacpp-native``, ``--llamacpp``), each imported only when asked for."""
    if args.real_size:
        from kvcore_bench.sizes import run_real_size

        args.progress = not args.no_progress
        return run_real_size(args)
    if args.scale:
        from kvcore_bench.scale import run_scale

        args.progress = not args.no_progress
        return run_scale(args)
    if args.llamacpp_native:
        from kvcore_bench.vs_native import run_native

        args.progress = not args.no_progress
        return run_native(args)
    if args.llamacpp:
        from kvcore_bench.vs_llamacpp import run_llamacpp

        args.progress = not args.no_progress
        return run_llamacpp(args)
    settings = settings_from_args(args)
    bench = Bench(settings)
    bench.validate_backends()
    report = bench.run()
    paths = write_outputs(report, Path(settings.out))
    print(render_target_table(report))
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0


class Bench(Harness):
    """Every case the settings name, in order, on one :class:`~kvcore_bench.harness.Harness`."""

    def __init__(self, settings: BenchSettings) -> None:
        super().__init__(settings)
        self.capacity: dict[str, Any] | None = None
        self.scaling: dict[str, dict[int, float]] = {}
        self.chunked: dict[str, Any] | None = None
        self.speculative: dict[str, Any] | None = None

    def run(self) -> dict[str, Any]:
        import torch

        started = time.perf_counter()
        env = environment()
        self.log(f"threads {torch.get_num_threads()}, load average {env.get('load_average')}")
        n = self.s.num_new_tokens
        short = min(64, self.window(n))
        for case in self.s.cases:
            t0 = time.perf_counter()
            self.log(f"case {case}")
            if case == "decode":
                self.compare("decode", torch.float32, [self.prompt(short)], n, self.s.reps_short)
            elif case == "long":
                long_n = max(2, n // 2)
                length = min(self.s.long_context, self.window(long_n))
                self.compare("long", torch.float32, [self.prompt(length)], long_n, self.s.reps_long)
            elif case == "bf16":
                self.compare("bf16", torch.bfloat16, [self.prompt(short)], n, self.s.reps_short)
            elif case == "batch":
                lengths = [min(x, self.window(n)) for x in (12, 25, 33, 48, 64, 80, 97, 120)]
                prompts = [self.prompt(length, salt=7 * i) for i, length in enumerate(lengths)]
                self.compare("batch", torch.float32, prompts, n, self.s.reps_short, max_num_seqs=len(prompts))
            elif case == "capacity":
                self.capacity = cases.capacity(self)
            elif case == "scaling":
                self.scaling = cases.scaling(self)
            elif case == "chunked":
                self.chunked = cases.chunked(self)
            elif case == "speculative":
                self.speculative = cases.speculative(self)
            self.log(f"case {case} done in {time.perf_counter() - t0:.0f}s")
        env["load_average_end"] = load_average()
        env["elapsed_s"] = round(time.perf_counter() - started, 1)
        return {
            "settings": asdict(self.s),
            "environment": env,
            "measurements": [asdict(m) for m in self.measurements],
            "capacity": self.capacity,
            "scaling": {k: {str(c): v for c, v in d.items()} for k, d in self.scaling.items()},
            "chunked": self.chunked,
            "speculative": self.speculative,
            "targets": evaluate_targets(self.measurements, self.capacity, self.scaling, self.chunked),
            "notes": self.notes,
        }
