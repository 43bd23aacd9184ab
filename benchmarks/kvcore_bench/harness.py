"""The harness of ``kvcore bench``'s backend comparison: the model and engines it builds, and
:meth:`Harness.compare`, which runs every backend and transformers side by side, alternating.

The cases (:mod:`kvcore_bench.cases`) and the command (:mod:`kvcore_bench.bench`) build on it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcore_bench.common import TEXT, median
from kvcore_bench.runs import RunStats, build_transformers_model, hf_run, kv_run
from kvcore_bench.settings import TARGET_BACKEND, BenchSettings

__all__ = ["Harness", "Measurement"]


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


def _summarise(case: str, side: str, runs: list[RunStats]) -> Measurement:
    return Measurement(
        case=case, side=side, runs=len(runs),
        ttft_s=median(r.ttft_s for r in runs),
        tpot_s=median(r.tpot_s for r in runs),
        decode_tok_s=median(r.decode_tok_s for r in runs),
        peak_rss_mib=max((r.peak_rss_mib for r in runs if r.peak_rss_mib is not None), default=None),
        kv_bytes_allocated=runs[-1].kv_bytes_allocated,
        kv_bytes_peak=max((r.kv_bytes_peak for r in runs if r.kv_bytes_peak is not None), default=None),
    )


class Harness:
    """The loaded model, its engines and transformers' twin, and side-by-side runs on them."""

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
        ids = tok.encode(TEXT, add_bos=False)
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

