"""What one ``kvcore bench`` run (the backend comparison) measures: :class:`BenchSettings`, from the flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvcore_bench.cli import CASES, DEFAULT_BACKENDS

__all__ = ["TARGET_BACKEND", "BenchSettings", "settings_from_args"]

TARGET_BACKEND = "sdpa"  # the engine's default choice on CPU: the targets are judged on it


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

