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
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvcore_bench import cli as _cli
from kvcore_bench.cli import CASES, DEFAULT_BACKENDS

__all__ = ["add_parser", "run", "BenchSettings", "Bench", "CASES"]

TARGET_BACKEND = "sdpa"  # the engine's default choice on CPU: the targets are judged on it

#: the performance targets: (key, description, comparison, threshold)
TARGETS = (
    ("decode", "decode tok/s, fp32, batch 1, 64-token context", ">=", 1.15),
    ("long", "decode tok/s, fp32, batch 1, 2048-token context", ">=", 1.5),
    ("bf16", "decode tok/s, bf16, batch 1", ">=", 1.6),
    ("batch", "aggregate decode tok/s, 8 concurrent ragged requests", ">=", 1.3),
    ("ttft", "time to first token, 2048-token prompt", "<=", 0.8),
    ("capacity", "concurrent sequences under a fixed KV budget: paged vs contiguous", ">=", 2.0),
    ("scaling", "decode step time at 4096 vs 64 context", "<=", 1.6),
    ("chunked", "worst inter-token gap (CPU time) while a 2048-token prompt is admitted: chunked vs whole", "<=",
     0.33),
)

_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press into a system that could reproduce pages "
    "quickly and cheaply. Within a few decades presses operated in more than two hundred European cities, "
    "and the number of books in circulation grew from thousands to millions. Scholars could compare "
    "identical copies of a text, merchants printed price lists and contracts, and pamphlets carried news "
    "and arguments faster than any messenger. "
)


# -- settings ------------------------------------------------------------------------------------------
@dataclass
class BenchSettings:
    quick: bool = False
    backends: tuple[str, ...] = DEFAULT_BACKENDS
    transformers: bool = True
    out: str = "bench-out"
    cases: tuple[str, ...] = CASES
    model: str = "smollm2"
    threads: int = 0  # 0 = torch's default
    reps: int | None = None  # None = 2 (quick) / 5 (full); long prompts use fewer
    progress: bool = True

    #: sizes (None = the defaults below, scaled down by ``quick``; always clamped to the model's window)
    new_tokens: int | None = None
    long_context: int = 2048
    contexts: tuple[int, ...] | None = None

    @property
    def reps_short(self) -> int:
        return self.reps or (2 if self.quick else 5)

    @property
    def reps_long(self) -> int:
        return self.reps or (1 if self.quick else 3)

    @property
    def num_new_tokens(self) -> int:
        return self.new_tokens or (16 if self.quick else 32)

    @property
    def context_lengths(self) -> tuple[int, ...]:
        return self.contexts or ((64, 1024, 4096) if self.quick else (64, 256, 1024, 2048, 4096))


def add_parser(subparsers) -> argparse.ArgumentParser:
    """The ``bench`` subcommand (declared in :mod:`kvcore_bench.cli`) running :func:`run`."""
    return _cli.add_parser(subparsers, run)


def _split(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    from kvcore.errors import ConfigError

    cases = _split(args.cases)
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        raise ConfigError(f"unknown bench case(s) {', '.join(unknown) or '(none)'} (choose from: {', '.join(CASES)})")
    backends = _split(args.backends)
    if not backends:
        raise ConfigError("--backends is empty")
    if args.threads < 0:
        raise ConfigError(f"--threads must be >= 0, got {args.threads}")
    if args.reps is not None and args.reps <= 0:
        raise ConfigError(f"--reps must be positive, got {args.reps}")
    return BenchSettings(
        quick=args.quick, backends=backends, transformers=not args.no_transformers, out=args.out, cases=cases,
        model=args.model, threads=args.threads, reps=args.reps, progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
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


# -- measurement primitives ---------------------------------------------------------------------------
@dataclass
class RunStats:
    """One generation run of ``B`` requests (kvcore or transformers)."""

    ttft_s: float  # mean over the requests
    tpot_s: float | None  # mean over the requests
    decode_tok_s: float | None  # tokens after each request's first / (last token time - first token time)
    token_ids: list[list[int]]
    wall_s: float
    peak_rss_mib: float | None = None
    kv_bytes_allocated: int | None = None
    kv_bytes_peak: int | None = None  # peak of the cache's bytes holding live tokens
    step_times_s: list[float] = field(default_factory=list)  # decode step intervals (kvcore)
    extra: dict[str, Any] = field(default_factory=dict)


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM (Linux >= 4.0)
            f.write("5")
    except OSError:
        pass


def _peak_rss_mib() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except Exception:  # pragma: no cover - non-POSIX
        return None


def kv_run(engine, prompts: Sequence[Sequence[int]], new_tokens: int) -> RunStats:
    """Submit ``prompts`` together, step the engine to completion, and time every token event."""
    from kvcore.interfaces.sampler import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    _reset_peak_rss()
    start = time.perf_counter()
    ids = [engine.add_request(list(p), params) for p in prompts]
    times: dict[str, list[float]] = {rid: [] for rid in ids}
    step_ends, kv_peak = [], 0
    while engine.has_unfinished():
        events = engine.step()
        now = time.perf_counter()
        step_ends.append(now)
        kv_peak = max(kv_peak, engine.kv.kv_bytes_in_use())
        for event in events:
            if event.token_id is not None:
                times[event.request_id].append(now)
    wall = time.perf_counter() - start
    results = [engine.release(rid) for rid in ids]
    for r in results:
        if r.error is not None:
            raise r.error
    stats = _stats(
        ttfts=[r.metrics.ttft_s for r in results],
        token_times=[times[rid] for rid in ids],
        token_ids=[r.token_ids for r in results],
        wall=wall,
        peak_rss=_peak_rss_mib(),
        kv_alloc=engine.cache.kv_bytes_allocated,
        kv_peak=kv_peak,
        step_times=[b - a for a, b in zip(step_ends[1:], step_ends[2:])],
    )
    stats.extra["cached_prompt_tokens"] = sum(r.metrics.num_cached_tokens for r in results)
    return stats


def _stats(ttfts, token_times, token_ids, wall, peak_rss=None, kv_alloc=None, kv_peak=None, step_times=()):
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in token_times if len(t) > 1]
    after_first = sum(len(t) - 1 for t in token_times)
    first, last = min(t[0] for t in token_times), max(t[-1] for t in token_times)
    return RunStats(
        ttft_s=statistics.fmean(ttfts),
        tpot_s=statistics.fmean(tpots) if tpots else None,
        decode_tok_s=after_first / (last - first) if after_first and last > first else None,
        token_ids=token_ids,
        wall_s=wall,
        peak_rss_mib=peak_rss,
        kv_bytes_allocated=kv_alloc,
        kv_bytes_peak=kv_peak,
        step_times_s=list(step_times),
    )


def hf_run(model, prompts: Sequence[Sequence[int]], new_tokens: int, pad_id: int) -> RunStats:
    """``model.generate`` (greedy, EOS suppressed) on left-padded prompts; a streamer timestamps every step."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(list(p))
        mask[i, width - len(p):] = 1
    clock = Clock()
    _reset_peak_rss()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, streamer=clock, pad_token_id=pad_id,
        )
    wall = time.perf_counter() - start
    steps = clock.times[1:]  # the first put is the prompt itself
    return _stats(
        ttfts=[steps[0] - start] * len(prompts),
        token_times=[steps] * len(prompts),
        token_ids=out[:, width:].tolist(),
        wall=wall,
        peak_rss=_peak_rss_mib(),
        step_times=[b - a for a, b in zip(steps, steps[1:])],
    )


def build_transformers_model(loaded, dtype):
    """transformers' ``LlamaForCausalLM`` holding exactly ``loaded``'s dequantized weights (no download)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    c = loaded.config
    eos = c.eos_token_ids[0] if c.eos_token_ids else 0
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id, eos_token_id=eos,
        pad_token_id=eos, attn_implementation="sdpa",
    )
    with torch.device("meta"):  # no random init: every parameter is assigned below
        model = LlamaForCausalLM(hf_config)
    state = {name: w.to(dtype) for name, w in loaded.weights.items()}  # float32: the same tensors, no copy
    if c.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, assign=True, strict=True)
    model.model.rotary_emb = LlamaRotaryEmbedding(config=hf_config)  # its inv_freq buffer was on meta
    model.eval()
    gc = model.generation_config
    gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None
    gc.pad_token_id, gc.eos_token_id, gc.bos_token_id = eos, eos, c.bos_token_id
    return model


# -- the benchmark -------------------------------------------------------------------------------------
@dataclass
class Measurement:
    """Medians over repetitions of one (case, side) pair; ``side`` is a backend name or "transformers"."""

    case: str
    side: str
    runs: int
    ttft_s: float | None
    tpot_s: float | None
    decode_tok_s: float | None
    peak_rss_mib: float | None
    kv_bytes_allocated: int | None
    kv_bytes_peak: int | None
    tokens_match_transformers: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _summarise(case: str, side: str, runs: list[RunStats]) -> Measurement:
    return Measurement(
        case=case, side=side, runs=len(runs),
        ttft_s=_median(r.ttft_s for r in runs),
        tpot_s=_median(r.tpot_s for r in runs),
        decode_tok_s=_median(r.decode_tok_s for r in runs),
        peak_rss_mib=max((r.peak_rss_mib for r in runs if r.peak_rss_mib is not None), default=None),
        kv_bytes_allocated=runs[-1].kv_bytes_allocated,
        kv_bytes_peak=max((r.kv_bytes_peak for r in runs if r.kv_bytes_peak is not None), default=None),
    )


class Bench:
    def __init__(self, settings: BenchSettings) -> None:
        import torch

        self.s = settings
        if settings.threads:
            torch.set_num_threads(settings.threads)
        self._loaded = None
        self._kv_models: dict[Any, Any] = {}
        self._hf_models: dict[Any, Any] = {}
        self._hf_error: str | None = None
        self.measurements: list[Measurement] = []
        self.capacity: dict[str, Any] | None = None
        self.scaling: dict[str, dict[int, float]] = {}
        self.chunked: dict[str, Any] | None = None
        self.speculative: dict[str, Any] | None = None
        self.notes: list[str] = []

    # -- resources ---------------------------------------------------------------------------------
    def log(self, message: str) -> None:
        if self.s.progress:
            print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    def validate_backends(self) -> None:
        """Fail fast (before loading anything big) on an unknown or unusable backend name."""
        from kvcore.plugins.registry import get_registry

        registry = get_registry()
        for name in self.s.backends:
            registry.create(name)

    @property
    def loaded(self):
        if self._loaded is None:
            from kvcore.loaders import load_model

            self.log(f"loading {self.s.model}")
            self._loaded = load_model(self.s.model)
        return self._loaded

    def kv_model(self, dtype):
        if dtype not in self._kv_models:
            from kvcore.model.decoder import LlamaModel

            self._kv_models[dtype] = LlamaModel.from_weights(self.loaded.config, self.loaded.weights, dtype)
        return self._kv_models[dtype]

    def hf_model(self, dtype):
        """transformers' model in ``dtype``, or None (not installed / disabled / failed: see notes)."""
        if not self.s.transformers or self._hf_error is not None:
            return None
        if dtype not in self._hf_models:
            try:
                import transformers  # noqa: F401
            except ImportError:
                self._hf_error = "transformers is not installed: no comparison"
                self.notes.append(self._hf_error)
                return None
            try:
                self._hf_models[dtype] = build_transformers_model(self.loaded, dtype)
            except Exception as exc:  # a transformers API change must not sink the kvcore numbers
                self._hf_error = f"could not build the transformers model: {type(exc).__name__}: {exc}"
                self.notes.append(self._hf_error)
                return None
        return self._hf_models[dtype]

    @property
    def pad_id(self) -> int:
        eos = self.loaded.config.eos_token_ids
        return eos[0] if eos else 0

    def prompt(self, length: int, salt: int = 0) -> list[int]:
        """``length`` token ids of natural text (the passage repeated), shifted by ``salt`` tokens."""
        tok = self.loaded.tokenizer
        ids = tok.encode(_TEXT, add_bos=False)
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        body = (ids * (length // len(ids) + 2))[salt : salt + length - len(bos)]
        return bos + body

    def engine(self, name: str | None, dtype, **config):
        """An engine on ``name`` for both phases (or on the phases ``config`` names), no tokenizer."""
        from kvcore.engine.core import Engine, EngineConfig

        if name is not None:
            config["backend"] = name
        return Engine(self.kv_model(dtype), None, EngineConfig(dtype=str(dtype).removeprefix("torch."), **config))

    # -- alternating side-by-side runs --------------------------------------------------------------
    def window(self, new_tokens: int) -> int:
        """The longest prompt that leaves room for ``new_tokens`` in the model's context window."""
        return self.loaded.config.max_position_embeddings - new_tokens - 8

    def compare(
        self, case: str, dtype, prompts: list[list[int]], new_tokens: int, reps: int,
        max_num_seqs: int = 1, backends: Sequence[str] | None = None,
    ) -> dict[str, Measurement]:
        """Run every backend and transformers ``reps`` times, rotating their order each repetition."""
        max_model_len = max(len(p) for p in prompts) + new_tokens + 8
        engines = {
            name: self.engine(name, dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
            for name in (backends or self.s.backends)
        }
        hf = self.hf_model(dtype)

        def once(name: str, run_prompts, tokens) -> RunStats:
            if name == "transformers":
                return hf_run(hf, run_prompts, tokens, self.pad_id)
            return kv_run(engines[name], run_prompts, tokens)

        names = list(engines) + (["transformers"] if hf is not None else [])
        for name in names:  # warm-up: first-call allocations, kernel selection, lazy imports
            once(name, [p[:64] for p in prompts], min(new_tokens, 4))
        # The pair the targets compare runs back to back (alternating which goes first), the other sides
        # rotate around it: a burst of load from elsewhere then hits both halves of a pair alike.
        pair = [n for n in (TARGET_BACKEND, "transformers") if n in names]
        others = [n for n in names if n not in pair]
        runs: dict[str, list[RunStats]] = {n: [] for n in names}
        for rep in range(reps):
            rotated = others[rep % len(others):] + others[: rep % len(others)] if others else []
            order = rotated + pair if rep % 2 == 0 else pair[::-1] + rotated
            for name in order:
                runs[name].append(once(name, prompts, new_tokens))
            self.log(f"{case}: rep {rep + 1}/{reps}: " + ", ".join(
                f"{n} {runs[n][-1].decode_tok_s or 0:.2f} tok/s ttft {runs[n][-1].ttft_s:.2f}s" for n in names))
        out = {}
        for name in names:
            m = _summarise(case, name, runs[name])
            if "transformers" in runs and name != "transformers":
                ref = runs["transformers"]
                m.tokens_match_transformers = runs[name][-1].token_ids == ref[-1].token_ids
                # per-repetition ratios of back-to-back runs (their median is what the targets use)
                m.extra["paired_decode_ratio"] = [
                    a.decode_tok_s / b.decode_tok_s
                    for a, b in zip(runs[name], ref)
                    if a.decode_tok_s and b.decode_tok_s
                ]
                m.extra["paired_ttft_ratio"] = [a.ttft_s / b.ttft_s for a, b in zip(runs[name], ref)]
            out[name] = m
            self.measurements.append(m)
        return out

    # -- cases ---------------------------------------------------------------------------------------
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
                self.run_capacity()
            elif case == "scaling":
                self.run_scaling()
            elif case == "chunked":
                self.run_chunked()
            elif case == "speculative":
                self.run_speculative()
            self.log(f"case {case} done in {time.perf_counter() - t0:.0f}s")
        env["load_average_end"] = _load_average()
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

    def run_capacity(self) -> None:
        """Concurrency under one KV byte budget: contiguous (max_model_len per slot) vs paged (blocks)."""
        import torch

        contiguous = next((b for b in ("sdpa", "naive") if b in self.s.backends), "sdpa")
        max_len = min(1024 if self.s.quick else 2048, self.loaded.config.max_position_embeddings)
        slots, block_size = 4, 16
        num_requests = 16 if self.s.quick else 24
        new_tokens = 4 if self.s.quick else 8
        cfg = self.loaded.config
        bytes_per_token = cfg.kv_bytes_per_token(4)
        budget = slots * max_len * bytes_per_token
        # mixed lengths: spread evenly over [max_len / 32, max_len / 4]
        lo, hi = max(2, max_len // 32), max_len // 4
        lengths = [lo + (hi - lo) * i // (num_requests - 1) for i in range(num_requests)]
        order = sorted(range(num_requests), key=lambda i: (i * 7) % num_requests)  # interleave short and long
        prompts = [self.prompt(lengths[i], salt=i) for i in order]
        engines = {
            f"contiguous ({contiguous})": self.engine(contiguous, torch.float32, max_num_seqs=slots,
                                                       max_model_len=max_len),
            "paged": self.engine("paged", torch.float32, max_num_seqs=num_requests, max_model_len=max_len,
                                 block_size=block_size, num_blocks=budget // (block_size * bytes_per_token)),
        }
        result: dict[str, Any] = {
            "kv_budget_bytes": budget, "max_model_len": max_len, "requests": num_requests,
            "prompt_lengths": [lengths[i] for i in order], "new_tokens": new_tokens, "caches": {},
        }
        for label, eng in engines.items():
            if eng.cache.kv_bytes_allocated > budget:
                raise AssertionError(f"{label} cache exceeds the budget")  # pragma: no cover - a bug
            stats = self._capacity_run(eng, prompts, new_tokens)
            stats["kv_bytes_allocated"] = eng.cache.kv_bytes_allocated
            result["caches"][label] = stats
            self.log(f"capacity: {label}: {stats['max_concurrent']} concurrent, {stats['wall_s']:.1f}s")
        c, p = (result["caches"][k]["max_concurrent"] for k in engines)
        result["ratio"] = p / c
        self.capacity = result

    @staticmethod
    def _capacity_run(engine, prompts, new_tokens) -> dict[str, Any]:
        from kvcore.interfaces.sampler import SamplingParams

        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        start = time.perf_counter()
        ids = [engine.add_request(p, params) for p in prompts]
        concurrency, kv_peak = [], 0
        while engine.has_unfinished():
            engine.step()
            concurrency.append(engine.num_running)
            kv_peak = max(kv_peak, engine.kv.kv_bytes_in_use())
        wall = time.perf_counter() - start
        results = [engine.release(rid) for rid in ids]
        generated = sum(len(r.token_ids) for r in results)
        return {
            "max_concurrent": max(concurrency),
            "mean_concurrent": round(statistics.fmean(concurrency), 2),
            "steps": len(concurrency),
            "preemptions": sum(r.metrics.num_preemptions for r in results),
            "errors": sum(r.error is not None for r in results),
            "kv_bytes_peak_in_use": kv_peak,
            "wall_s": round(wall, 2),
            "generated_tok_s": round(generated / wall, 2),
        }

    def run_chunked(self) -> None:
        """Inter-token gaps of running requests while a long prompt is admitted: chunked vs whole prefill.
        Both modes alternate per repetition; figures are medians over repetitions."""
        import torch

        backend = TARGET_BACKEND if TARGET_BACKEND in self.s.backends else self.s.backends[0]
        length = min(self.s.long_context, self.window(16))
        budget = max(16, length // 16)  # the 2048-token prompt in 16 chunks of 128 (minus the 4 decode rows)
        runs: dict[str, list[dict[str, float]]] = {"whole": [], "chunked": []}
        for rep in range(self.s.reps_long):
            for label in ("whole", "chunked") if rep % 2 == 0 else ("chunked", "whole"):
                chunked = label == "chunked"
                eng = self.engine(backend, torch.float32, max_num_seqs=5, max_model_len=length + 16,
                                  enable_chunked_prefill=chunked, max_num_batched_tokens=budget if chunked else 8192)
                runs[label].append(self._gap_run(eng, length, budget))
                r = runs[label][-1]
                self.log(f"chunked: {label}: worst gap {r['worst_gap_s']:.3f}s wall, {r['worst_gap_cpu_s']:.2f}s CPU")
        result: dict[str, Any] = {"backend": backend, "prompt_tokens": length, "budget": budget, "modes": {}}
        for label, stats in runs.items():
            result["modes"][label] = {k: _median([r[k] for r in stats]) for k in stats[0]}
        c, w = result["modes"]["chunked"], result["modes"]["whole"]
        result["ratio_wall"] = c["worst_gap_s"] / w["worst_gap_s"]
        result["ratio"] = c["worst_gap_cpu_s"] / w["worst_gap_cpu_s"]  # robust to load from other processes
        self.chunked = result

    def run_speculative(self) -> None:
        """Batch-1 decode with n-gram speculation vs without (float32, alternating per repetition): a random
        token sequence given two and a half times, which the model goes on copying."""
        import torch

        from kvcore.interfaces.sampler import SamplingParams

        backend = TARGET_BACKEND if TARGET_BACKEND in self.s.backends else self.s.backends[0]
        n = self.s.num_new_tokens
        x = self.prompt(max(8, min(200, (self.window(n) - n) * 2 // 5)), salt=11)
        prompt = x + x + x[: len(x) // 2]
        runs: dict[str, list[dict[str, float]]] = {"base": [], "ngram": []}
        for rep in range(self.s.reps_short):
            for label in ("base", "ngram") if rep % 2 == 0 else ("ngram", "base"):
                extra = {"proposer": "ngram"} if label == "ngram" else {}
                eng = self.engine(backend, torch.float32, max_num_seqs=1, max_model_len=len(prompt) + n + 8, **extra)
                r = eng.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))[0]
                m = r.metrics
                runs[label].append({"decode_tok_s": m.tokens_per_s or 0.0, "draft_tokens": m.num_draft_tokens,
                                    "accepted_tokens": m.num_accepted_tokens,
                                    "acceptance_rate": m.acceptance_rate or 0.0,
                                    "mean_accepted_length": m.mean_accepted_length or 0.0,
                                    "tokens_per_step": m.tokens_per_step or 1.0})
        modes = {label: {k: _median([r[k] for r in stats]) for k in stats[0]} for label, stats in runs.items()}
        self.speculative = {"backend": backend, "prompt_tokens": len(prompt), "new_tokens": n, "modes": modes,
                            "speedup": modes["ngram"]["decode_tok_s"] / max(modes["base"]["decode_tok_s"], 1e-9)}
        self.log(f"speculative: x{self.speculative['speedup']:.2f}, acceptance {modes['ngram']['acceptance_rate']:.2f}")

    def _gap_run(self, engine, length: int, budget: int) -> dict[str, float]:
        from kvcore.interfaces.sampler import SamplingParams

        short = SamplingParams(max_new_tokens=8 + length // (budget - 8), ignore_eos=True)
        ids = [engine.add_request(self.prompt(32, salt=5 * i), short) for i in range(4)]
        for _ in range(4):  # prefill them, then steady decoding
            engine.step()
        # Wall clock is what a user feels; this process's CPU time is the same measure with the time other
        # processes take from a shared machine left out (on an idle machine the two ratios agree).
        last = dict.fromkeys(ids, (time.perf_counter(), time.process_time()))
        long_id = engine.add_request(self.prompt(length, salt=3), SamplingParams(max_new_tokens=2, ignore_eos=True))
        arrival, ttft, gaps, cpu_gaps, waited = time.perf_counter(), None, [], [], set()
        while (ttft is None or len(waited) < len(ids)) and engine.has_unfinished():
            events = engine.step()
            now = (time.perf_counter(), time.process_time())
            for e in events:
                if e.request_id == long_id:
                    ttft = now[0] - arrival
                elif e.request_id in last:
                    gaps.append(now[0] - last[e.request_id][0])
                    cpu_gaps.append(now[1] - last[e.request_id][1])
                    last[e.request_id] = now
                    waited.add(e.request_id)
        for rid in [*ids, long_id]:
            engine.abort(rid)
            engine.release(rid)
        return {"worst_gap_s": max(gaps), "median_gap_s": statistics.median(gaps), "long_ttft_s": ttft,
                "worst_gap_cpu_s": max(cpu_gaps)}

    def run_scaling(self) -> None:
        """Median decode step time of one sequence at each context length, per backend.

        Every (backend, context) pair gets its own engine holding one prefilled request; then rounds of
        a few timed decode steps visit every pair in turn, so a burst of load from elsewhere on the
        machine hits all contexts alike instead of skewing one point of the curve.
        """
        import torch

        from kvcore.interfaces.sampler import SamplingParams

        rounds, per_round = (3, 2) if self.s.quick else (5, 3)
        steps = rounds * per_round
        contexts = sorted({min(c, self.window(steps + 2)) for c in self.s.context_lengths})
        pairs = {}
        for name in self.s.backends:
            for ctx in contexts:
                max_len = ctx + steps + 8
                if self._cache_kind(name) == "contiguous" and name != "sdpa" and "sdpa" in self._registry_names():
                    # only decode is timed: let the fast backend build the context
                    eng = self.engine(None, torch.float32, prefill_backend="sdpa", decode_backend=name,
                                      max_num_seqs=1, max_model_len=max_len)
                else:
                    eng = self.engine(name, torch.float32, max_num_seqs=1, max_model_len=max_len)
                kv_run(eng, [self.prompt(8)], 3)  # warm-up
                rid = eng.add_request(self.prompt(ctx), SamplingParams(max_new_tokens=steps + 2, ignore_eos=True))
                eng.step()  # prefill (untimed)
                eng.step()  # first decode step (untimed)
                pairs[name, ctx] = (eng, rid, [])
            self.log(f"scaling: {name}: contexts {', '.join(map(str, contexts))} prefilled")
        for _ in range(rounds):
            for eng, _, times in pairs.values():
                for _ in range(per_round):
                    start = time.perf_counter()
                    eng.step()
                    times.append(time.perf_counter() - start)
        for (name, ctx), (eng, rid, times) in pairs.items():
            eng.abort(rid)
            eng.release(rid)
            self.scaling.setdefault(name, {})[ctx] = statistics.median(times)
        for name, series in self.scaling.items():
            self.log(f"scaling: {name}: " + ", ".join(f"{c}: {t * 1e3:.1f} ms" for c, t in series.items()))
        pairs.clear()
        hf = None if self.s.quick else self.hf_model(torch.float32)
        if hf is not None:  # generate() cannot be paused: one run per context (informational line)
            hf_run(hf, [self.prompt(16)], 3, self.pad_id)
            series = {}
            for ctx in contexts:
                stats = hf_run(hf, [self.prompt(ctx)], 8, self.pad_id)
                series[ctx] = statistics.median(stats.step_times_s)
                self.log(f"scaling: transformers ctx {ctx}: {series[ctx] * 1e3:.1f} ms/step")
            self.scaling["transformers"] = series

    @staticmethod
    def _registry_names() -> list[str]:
        from kvcore.plugins.registry import get_registry

        return list(get_registry().backends)

    @staticmethod
    def _cache_kind(name: str) -> str:
        from kvcore.plugins.registry import get_registry

        return get_registry().backends[name].cls.capabilities.kv_layouts[0]


# -- targets, tables, plot -----------------------------------------------------------------------------
def _find(measurements, case, side) -> Measurement | None:
    return next((m for m in measurements if m.case == case and m.side == side), None)


def evaluate_targets(measurements, capacity, scaling, chunked=None) -> list[dict[str, Any]]:
    rows = []
    for key, label, op, threshold in TARGETS:
        row: dict[str, Any] = {"key": key, "case": label, "target": f"{'≥' if op == '>=' else '≤'} {threshold}×",
                               "kvcore": None, "reference": None, "ratio": None, "met": None}
        if key in ("decode", "long", "bf16", "batch", "ttft"):
            case = "long" if key == "ttft" else key
            ours, ref = _find(measurements, case, TARGET_BACKEND), _find(measurements, case, "transformers")
            if ours is not None and ref is not None:
                paired = ours.extra.get("paired_ttft_ratio" if key == "ttft" else "paired_decode_ratio")
                if key == "ttft":
                    row.update(kvcore=f"{ours.ttft_s:.2f} s", reference=f"{ref.ttft_s:.2f} s",
                               ratio=_median(paired) if paired else ours.ttft_s / ref.ttft_s)
                elif ours.decode_tok_s and ref.decode_tok_s:
                    row.update(kvcore=f"{ours.decode_tok_s:.2f} tok/s", reference=f"{ref.decode_tok_s:.2f} tok/s",
                               ratio=_median(paired) if paired else ours.decode_tok_s / ref.decode_tok_s)
                if paired:
                    row["paired_ratios"] = [round(r, 3) for r in paired]
        elif key == "capacity" and capacity:
            (c_label, c), (p_label, p) = capacity["caches"].items()
            row.update(kvcore=f"paged {p['max_concurrent']}", reference=f"{c_label} {c['max_concurrent']}",
                       ratio=capacity["ratio"])
        elif key == "scaling" and TARGET_BACKEND in scaling:
            series = scaling[TARGET_BACKEND]
            if 64 in series and 4096 in series:
                row.update(kvcore=f"{series[4096] * 1e3:.1f} ms @4096", reference=f"{series[64] * 1e3:.1f} ms @64",
                           ratio=series[4096] / series[64])
        elif key == "chunked" and chunked:
            c, w = chunked["modes"]["chunked"], chunked["modes"]["whole"]
            row.update(kvcore=f"chunked {c['worst_gap_cpu_s']:.2f} CPU s",
                       reference=f"whole {w['worst_gap_cpu_s']:.2f} CPU s", ratio=chunked["ratio"])
        if row["ratio"] is not None:
            row["met"] = row["ratio"] >= threshold if op == ">=" else row["ratio"] <= threshold
        rows.append(row)
    return rows


def _fmt(value, spec: str = ".2f", unit: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{unit}"


def render_target_table(report: dict[str, Any]) -> str:
    lines = [
        f"| case | kvcore ({TARGET_BACKEND}) | reference | ratio | target | met |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["targets"]:
        met = "–" if row["met"] is None else ("yes" if row["met"] else "**no**")
        lines.append(f"| {row['case']} | {row['kvcore'] or '–'} | {row['reference'] or '–'} | "
                     f"{_fmt(row['ratio'], '.2f', '×')} | {row['target']} | {met} |")
    return "\n".join(lines)


def render_markdown(report: dict[str, Any]) -> str:
    env, s = report["environment"], report["settings"]
    out = [
        "# kvcore bench",
        "",
        f"Command: `{env.get('command', 'kvcore bench')}`  ",
        f"Model: {s['model']}; torch {env.get('torch')} ({env.get('threads')} threads); "
        f"transformers {env.get('transformers') or 'not used'}; CPU: {env.get('cpu')}; "
        f"load average at start {env.get('load_average')}, at end {env.get('load_average_end')}; "
        f"{env.get('elapsed_s')} s in all.",
        "",
        "## Targets",
        "",
        f"Ratios are kvcore's `{TARGET_BACKEND}` backend (the engine's default on CPU) against transformers "
        "(sdpa) on the same weights and dtype, in one process: the two run back to back in every repetition "
        "and the ratio is the median of the per-repetition ratios (the kvcore / reference columns are "
        "medians of each side). Capacity and scaling come from the engine alone.",
        "",
        render_target_table(report),
        "",
        "## Per backend",
        "",
        "| case | side | runs | TTFT | TPOT | decode tok/s | peak RSS | KV allocated | KV peak in use "
        "| same tokens as transformers |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in report["measurements"]:
        same = "–" if m["tokens_match_transformers"] is None else ("yes" if m["tokens_match_transformers"] else "no")
        out.append(
            f"| {m['case']} | {m['side']} | {m['runs']} | {_fmt(m['ttft_s'], '.3f', ' s')} | "
            f"{_fmt(m['tpot_s'] and m['tpot_s'] * 1e3, '.1f', ' ms')} | {_fmt(m['decode_tok_s'])} | "
            f"{_fmt(m['peak_rss_mib'], '.0f', ' MiB')} | {_fmt(_mib(m['kv_bytes_allocated']), '.1f', ' MiB')} | "
            f"{_fmt(_mib(m['kv_bytes_peak']), '.1f', ' MiB')} | {same} |"
        )
    cap = report.get("capacity")
    if cap:
        out += [
            "",
            "## Capacity under a fixed KV budget",
            "",
            f"Budget {_mib(cap['kv_budget_bytes']):.1f} MiB (= 4 contiguous slots of max_model_len "
            f"{cap['max_model_len']}); {cap['requests']} requests, prompts {min(cap['prompt_lengths'])}–"
            f"{max(cap['prompt_lengths'])} tokens, {cap['new_tokens']} new tokens each, submitted together.",
            "",
            "| cache | KV allocated | max concurrent | mean concurrent | steps | preemptions | peak KV in use | "
            "wall | generated tok/s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for label, c in cap["caches"].items():
            out.append(
                f"| {label} | {_mib(c['kv_bytes_allocated']):.1f} MiB | {c['max_concurrent']} | "
                f"{c['mean_concurrent']} | {c['steps']} | {c['preemptions']} | "
                f"{_mib(c['kv_bytes_peak_in_use']):.1f} MiB | {c['wall_s']} s | {c['generated_tok_s']} |"
            )
    if report.get("scaling"):
        sides = list(report["scaling"])
        contexts = sorted({int(c) for d in report["scaling"].values() for c in d})
        out += ["", "## Decode step time vs context (ms, batch 1, fp32)", "",
                "| context | " + " | ".join(sides) + " |", "|---|" + "---|" * len(sides)]
        for ctx in contexts:
            cells = [_fmt(report["scaling"][side].get(str(ctx)) and report["scaling"][side][str(ctx)] * 1e3, ".1f")
                     for side in sides]
            out.append(f"| {ctx} | " + " | ".join(cells) + " |")
        ratios = []
        for side in sides:
            d = report["scaling"][side]
            if "64" in d and "4096" in d:
                ratios.append(f"{side} {d['4096'] / d['64']:.2f}×")
        if ratios:
            out += ["", "4096 vs 64: " + ", ".join(ratios)]
    ch = report.get("chunked")
    if ch:
        out += ["", "## Chunked prefill", "",
                f"4 requests decoding on `{ch['backend']}` when a {ch['prompt_tokens']}-token prompt arrives; "
                f"chunked: {ch['budget']} tokens per step. Gaps are between a running request's tokens, "
                "from the prompt's arrival to its first token; the target is judged on the process's CPU time "
                f"(wall-clock ratio {ch['ratio_wall']:.2f}×).", "",
                "| prefill | worst gap (CPU) | worst gap (wall) | median gap (wall) | long prompt TTFT |",
                "|---|---|---|---|---|"]
        for label, m in ch["modes"].items():
            out.append(f"| {label} | {m['worst_gap_cpu_s']:.2f} s | {m['worst_gap_s']:.3f} s | "
                       f"{m['median_gap_s']:.3f} s | {m['long_ttft_s']:.3f} s |")
    sp = report.get("speculative")
    if sp:
        b, g = sp["modes"]["base"], sp["modes"]["ngram"]
        out += ["", "## Speculative decoding", "",
                f"Batch 1 on `{sp['backend']}`, a {sp['prompt_tokens']}-token input-grounded prompt, "
                f"{sp['new_tokens']} new tokens: n-gram speculation {g['decode_tok_s']:.1f} tok/s vs "
                f"{b['decode_tok_s']:.1f} tok/s without ({sp['speedup']:.2f}×); acceptance rate "
                f"{g['acceptance_rate']:.2f}, {g['mean_accepted_length']:.2f} drafts kept per verification, "
                f"{g['tokens_per_step']:.2f} tokens per decode step."]
    if report.get("notes"):
        out += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(out) + "\n"


def _mib(value):
    return None if value is None else value / 2**20


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_scaling(scaling: dict[str, dict[Any, float]], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for side, series in scaling.items():
        xs = sorted(int(c) for c in series)
        ax.plot(xs, [series[c if c in series else str(c)] * 1e3 for c in xs], marker="o", label=side)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode step time (ms)")
    ax.set_title("SmolLM2-135M decode step, batch 1, fp32")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(report: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.md", out_dir / "results.json"]
    paths[0].write_text(render_markdown(report))
    paths[1].write_text(json.dumps(report, indent=2, default=str) + "\n")
    if report.get("scaling"):
        png = out_dir / "decode_step_vs_context.png"
        if plot_scaling(report["scaling"], png):
            paths.append(png)
    return paths


# -- environment ---------------------------------------------------------------------------------------
def _load_average() -> str | None:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
        flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
        isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
        return f"{name or platform.processor()} × {os.cpu_count()} ({', '.join(isa) or 'no AVX2'})"
    except OSError:
        return f"{platform.processor()} × {os.cpu_count()}"


def machine_line(env: dict[str, Any]) -> str:
    """The reports' line naming the CPU, its vector extensions and torch's kernels (``env``: :func:`environment`)."""
    isa = ", ".join(k for k, v in env["isa"].items() if v) or "none of AVX2/AVX-512/AMX"
    return f"- CPU: {env['cpu']}; ISA: {isa}; torch CPU capability: {env['torch_cpu_capability']}"


def environment() -> dict[str, Any]:
    import torch

    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    return {
        "command": "kvcore " + " ".join(sys.argv[1:]) if "bench" in sys.argv[1:] else None,
        "torch": torch.__version__,
        "transformers": tf_version,
        "threads": torch.get_num_threads(),
        "cpu": _cpu_name(),
        "python": platform.python_version(),
        "load_average": _load_average(),
    }
