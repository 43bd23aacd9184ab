"""``kvcore bench --scale``: aggregate decode throughput against the number of concurrent requests, and at an 8k
context, kvcore beside native ``llama-batched-bench`` (llama.cpp's parallel sequences) on the same GGUF, same threads.

Points (``--quick`` shrinks them): ``short``, 1 / 8 / 32 / 64 concurrent requests of 128 random prompt tokens each,
generating 128 / 128 / 64 / 32 tokens (fewer at high concurrency keeps a run to minutes; the throughput is
steady long before), against ``llama-batched-bench -npp 128 -ntg N -npl P``; ``long``, 1 and 8 requests sharing
one 8160-token prompt (8192 with the 32 tokens they generate: SmolLM2's whole window), against
``llama-batched-bench -pps -kvu`` (the prompt computed once and shared by every sequence, as kvcore's prefix cache
shares it). Aggregate decode tok/s = tokens after each request's first / (last token - first token), summed over
the requests (kvcore); ``S_TG`` = ``speed_tg`` (llama.cpp). Time to first token: kvcore's mean over the requests
(one prefill of the shared prompt, the other requests hit the prefix cache), llama.cpp's ``T_PP`` (the prefill).

kvcore runs in this process twice per point: ``paged`` (the defaults, with the ``paged`` backend and prefix
caching on) and ``default`` (the defaults as they are: the backend they choose, its KV cache, no prefix caching;
at the long context with one request only, as eight would each prefill the whole prompt). Every repetition of
every point alternates which side goes first. ``--engine-option KEY=VALUE`` adds EngineConfig fields to both.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvcore_bench.common import cpu_features, describe_kernels, engine_options, environment, load_average
from kvcore_bench.runs import kv_run

__all__ = ["Plan", "FULL", "QUICK", "KvcoreSide", "llamacpp_point", "run_scale", "point_medians"]


@dataclass(frozen=True)
class Plan:
    """The points measured. ``new_tokens``: (concurrent requests, tokens each generates); ``long_context``:
    shared prompt + generated tokens (at most the model's context window)."""

    prompt_tokens: int = 128
    new_tokens: tuple[tuple[int, int], ...] = ((1, 128), (8, 128), (32, 64), (64, 32))
    long_context: int = 8192
    long_new_tokens: int = 32
    long_seqs: tuple[int, ...] = (1, 8)

    @property
    def long_prompt(self) -> int:
        """Tokens of the shared long prompt."""
        return self.long_context - self.long_new_tokens

    @property
    def max_seqs(self) -> int:
        return max(n for n, _ in self.new_tokens)


FULL = Plan()
QUICK = Plan(prompt_tokens=32, new_tokens=((1, 16), (8, 16)), long_context=512, long_new_tokens=8)
CONFIGS = ("paged", "default")


def _prompt(vocab: int, length: int, salt: int) -> list[int]:
    """Random token ids (as llama-batched-bench's), different for every ``salt``: nothing is shared by accident."""
    import torch

    gen = torch.Generator().manual_seed(salt)
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


class KvcoreSide:
    """kvcore's engines for the points of ``plan``, built on first use by ``build(EngineConfig) -> Engine``."""

    def __init__(self, build: Callable[[Any], Any], plan: Plan, options: dict[str, Any]) -> None:
        self.build, self.plan, self.options = build, plan, options
        self._engines: dict[tuple[str, bool], Any] = {}
        self.vocab = 0

    def engine(self, config: str, long: bool):
        key = (config, long)
        if key not in self._engines:
            from kvcore.engine.config import EngineConfig

            p = self.plan
            fields: dict[str, Any] = dict(self.options)
            if config == "paged":
                fields.update(backend="paged", enable_prefix_caching=True)
            if long:
                seqs = max(p.long_seqs) if config == "paged" else 1
                length = p.long_context
                if config == "paged":  # the shared prompt twice (one repetition's, evictable, and the next's) + tails
                    bs = fields.get("block_size", 16)
                    fields["num_blocks"] = 2 * (length // bs + 2) + seqs * (p.long_new_tokens // bs + 2)
            else:
                seqs, length = p.max_seqs, p.prompt_tokens + max(n for _, n in p.new_tokens)
            engine = self.build(EngineConfig(max_num_seqs=seqs, max_model_len=length, **fields))
            self.vocab = engine.model.config.vocab_size
            kv_run(engine, [_prompt(self.vocab, 16, 1)], 4)  # warm-up: kernels built, weights paged in
            kv_run(engine, [_prompt(self.vocab, 16, 2 + i) for i in range(min(seqs, 8))], 4)
            self._engines[key] = engine
        return self._engines[key]

    def short(self, config: str, seqs: int, new_tokens: int, salt: int) -> dict[str, float]:
        engine = self.engine(config, False)
        prompts = [_prompt(self.vocab, self.plan.prompt_tokens, salt * 1000 + i) for i in range(seqs)]
        return _figures(kv_run(engine, prompts, new_tokens))

    def long(self, config: str, seqs: int, salt: int) -> dict[str, float]:
        engine = self.engine(config, True)
        prompt = _prompt(self.vocab, self.plan.long_prompt, salt)  # cold: a new prompt every time
        return _figures(kv_run(engine, [prompt] * seqs, self.plan.long_new_tokens))

    def runs(self, config: str) -> bool:
        """Whether ``config`` is a configuration of its own (``default`` may resolve to the paged one)."""
        if config == "paged":
            return True
        return self.engine("default", False).decode_backend.name != "paged"

    def describe(self) -> dict[str, Any]:
        out = {}
        for (config, long), engine in self._engines.items():
            if not long:
                out[config] = {"kernels": describe_kernels(engine), "choice": engine.choice.as_dict(),
                               "prefix_caching": engine.config.enable_prefix_caching}
        return out


def _figures(stats) -> dict[str, float]:
    return {"tok_s": stats.decode_tok_s, "ttft_s": stats.ttft_s,
            "cached_prompt_tokens": stats.extra["cached_prompt_tokens"]}


def llamacpp_point(row: dict[str, Any]) -> dict[str, float]:
    """One ``llama-batched-bench --output-format jsonl`` row as this benchmark's figures: ``S_TG`` (aggregate
    decode tok/s) and ``T_PP`` (the prefill, of the one shared prompt with ``-pps``)."""
    return {"tok_s": row["speed_tg"], "ttft_s": row["t_pp"]}


def point_medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per side the median tok/s and TTFT over ``runs``, and the median of the per-run ratios kvcore / llama.cpp."""
    sides = [s for s in runs[0] if s not in ("rep", "load_average")]
    med = {s: {k: statistics.median(r[s][k] for r in runs) for k in ("tok_s", "ttft_s")} for s in sides}
    for s in sides:
        if s != "llama.cpp":
            med[s]["ratio"] = statistics.median(r[s]["tok_s"] / r["llama.cpp"]["tok_s"] for r in runs)
    return med


def _kvcore_side(kv: KvcoreSide, configs: list[str], kind: str, seqs: int, new: int, salt: int) -> dict[str, Any]:
    got = {}
    for config in configs:
        if kind == "short":
            got[f"kvcore {config}"] = kv.short(config, seqs, new, salt)
        elif config == "paged" or seqs == 1:
            got[f"kvcore {config}"] = kv.long(config, seqs, salt)
    return got


def run_points(kv: KvcoreSide, lc: Callable[..., dict[str, float]] | None, plan: Plan, reps: int,
               log: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """Every point of ``plan`` ``reps`` times, alternating kvcore and llama.cpp (``lc(kind, seqs, new_tokens)``;
    None: kvcore only)."""
    configs = [c for c in CONFIGS if kv.runs(c)]
    todo = [("short", n, new) for n, new in plan.new_tokens]
    todo += [("long", n, plan.long_new_tokens) for n in plan.long_seqs]
    points = []
    for i, (kind, seqs, new) in enumerate(todo):
        runs = []
        for rep in range(reps):
            salt = 7919 * (i + 1) + rep
            order = ["kvcore", "llama.cpp"] if lc is not None else ["kvcore"]
            run: dict[str, Any] = {"rep": rep, "load_average": load_average()}
            for side in order if rep % 2 == 0 else order[::-1]:
                if side == "kvcore":
                    run.update(_kvcore_side(kv, configs, kind, seqs, new, salt))
                else:
                    run["llama.cpp"] = lc(kind, seqs, new)
            runs.append(run)
            log(f"{kind} x{seqs}, rep {rep + 1}/{reps}: " + ", ".join(
                f"{s} {v['tok_s']:.1f} tok/s" for s, v in run.items() if isinstance(v, dict)))
        point = {"kind": kind, "seqs": seqs, "new_tokens": new, "runs": runs}
        point["prompt_tokens"] = plan.prompt_tokens if kind == "short" else plan.long_prompt
        if lc is not None:
            point["median"] = point_medians(runs)
        points.append(point)
    return points


def run_scale(args: argparse.Namespace) -> int:
    import json
    import sys

    import torch

    from kvcore.engine.core import Engine
    from kvcore.loaders.resolve import smollm2_path
    from kvcore_bench.native_llamacpp import batched_bench, build_tools, llama_bench
    from kvcore_bench.scale_report import render_scale, write_scale

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    path = smollm2_path() if args.model == "smollm2" else Path(args.model)
    plan = QUICK if args.quick else FULL
    reps = args.reps or (1 if args.quick else 2)
    bin_dir = build_tools(progress=args.progress)
    info = llama_bench(bin_dir, path, threads, 16)  # llama.cpp's build and CPU facts (and its weights paged in)

    def lc(kind: str, seqs: int, new: int) -> dict[str, float]:
        if kind == "short":
            (row,) = batched_bench(bin_dir, path, threads, [seqs], plan.prompt_tokens, new,
                                   ctx=seqs * (plan.prompt_tokens + new) + 64)
        else:
            prompt = plan.long_prompt
            (row,) = batched_bench(bin_dir, path, threads, [seqs], prompt, new, ctx=prompt + seqs * new + 64,
                                   shared_prompt=True)
        return llamacpp_point(row)

    def log(line: str) -> None:
        if args.progress:
            print(line, file=sys.stderr, flush=True)

    kv = KvcoreSide(lambda config: Engine.from_pretrained(str(path), config), plan,
                    engine_options(args.engine_option or []))
    start = time.perf_counter()
    points = run_points(kv, lc, plan, reps, log)
    report = {
        "environment": {**environment(), **cpu_features(), "threads": threads, "load_average_end": load_average()},
        "gguf": str(path), "plan": asdict(plan), "reps": reps, "seconds": time.perf_counter() - start,
        "kvcore": kv.describe(), "kvcore_options": kv.options,
        "llama_cpp": {"tools": str(bin_dir), "flags": "-b 2048 -ub 512 --no-repack; long: -pps -kvu",
                      **{k: info.get(k) for k in ("build_commit", "cpu_info", "backends", "n_threads")}},
        "points": points,
    }
    paths = write_scale(report, Path(args.out))
    print(render_scale(report))
    print("wrote " + ", ".join(map(str, paths)))
    print(json.dumps({"seconds": round(report["seconds"])}), file=sys.stderr)
    return 0

