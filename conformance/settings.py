"""Settings of one conformance run."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kvcore.conformance.limits import DEFAULT_CASE_TIMEOUT
from kvcore.engine.core import parse_dtype
from kvcore.errors import ConfigError
from kvcore.interfaces.dtypes import dtype_name

__all__ = ["SuiteConfig", "TIERS", "SAMPLER_TIERS", "PROPOSER_TIERS", "DEFAULT_MODELS", "ALL_DTYPES"]

#: tier names, in run order
TIERS = ("op", "cache", "stream", "sampling", "speculative")
#: the tiers that judge a sampler, all a sampler-only run needs: op and cache never call one, and the stream
#: tier runs the sampler under test on both sides (backend and reference), so it judges the backend
SAMPLER_TIERS = ("sampling",)
#: what certifying a speculative-decoding proposer alone runs
PROPOSER_TIERS = ("speculative",)
#: ``tiny``: a random-weights Llama built in memory (fast); ``smollm2``: the embedded default model
DEFAULT_MODELS = ("tiny", "smollm2")
#: what a run certifies by default: float32 (exact) and every reduced precision (tie-aware)
ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SuiteConfig:
    """``quick`` trims every tier to a CI-sized case set (the op matrix's corners, the first model only for
    the cache and sampling tiers, shorter streams).

    ``dtype``: ``None`` (the default) certifies float32 *and* every reduced precision (bfloat16,
    float16): cases in a dtype the backend or cache does not declare are skipped with that reason. A
    dtype given certifies that one only. ``dtypes`` is the resulting tuple (float32 first);
    ``dtype`` then names the first, the one a case without a dtype of its own runs in."""

    dtype: torch.dtype | str | None = None
    device: str = "cpu"
    quick: bool = False
    models: tuple[str, ...] = DEFAULT_MODELS
    tiers: tuple[str, ...] = TIERS
    tensor_parallel_size: int = 1  # ranks the engine-level tiers (stream, sampling) run the model on
    #: base of the seeds the sampler oracle draws with: a run is reproducible, another seed another trial
    seed: int = 0
    #: seconds a case may run before it fails as timed out, checked between engine steps (None: no limit)
    case_timeout: float | None = DEFAULT_CASE_TIMEOUT
    #: engine steps each engine run of a case may take (None: 4 per token it asks for, plus 64; see limits.py)
    max_steps: int | None = None
    #: registered attention variants (kvcore.interfaces.variants) the run selects: the op tier adds cases whose
    #: layers carry each, and every engine of the stream and sampling tiers attends with them (both sides)
    attention_variants: tuple[str, ...] = ()
    dtypes: tuple[torch.dtype, ...] = field(init=False)

    def __post_init__(self) -> None:
        dtypes = ALL_DTYPES if self.dtype is None else (parse_dtype(self.dtype),)
        object.__setattr__(self, "dtypes", dtypes)
        object.__setattr__(self, "dtype", dtypes[0])
        try:
            torch.device(self.device)
        except RuntimeError:
            raise ConfigError(f"unknown device '{self.device}'") from None
        unknown = [t for t in self.tiers if t not in TIERS]
        if unknown:
            raise ConfigError(f"unknown tier(s) {', '.join(unknown)} (choose from: {', '.join(TIERS)})")
        if not self.models:
            raise ConfigError("no model given for the model-level tiers")
        object.__setattr__(self, "tiers", tuple(t for t in TIERS if t in self.tiers))
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 1 << 32:
            raise ConfigError(f"seed must be an integer in [0, 2^32), got {self.seed!r}")
        t = self.case_timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise ConfigError(f"case_timeout must be a positive number of seconds or None, got {t!r}")
        m = self.max_steps
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ConfigError(f"max_steps must be a positive integer or None, got {m!r}")

    def for_dtype(self, dtype: torch.dtype | None) -> SuiteConfig:
        """This configuration narrowed to one dtype (a case's own); ``None`` keeps it."""
        if dtype is None or self.dtypes == (dtype,):
            return self
        return replace(self, dtype=dtype)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    def as_dict(self) -> dict:
        return {
            "dtype": self.dtype_name if len(self.dtypes) == 1 else "all",
            "dtypes": [dtype_name(d) for d in self.dtypes],
            "device": self.device,
            "quick": self.quick,
            "models": list(self.models),
            "tiers": list(self.tiers),
            "tensor_parallel_size": self.tensor_parallel_size,
            "seed": self.seed,
            "case_timeout": self.case_timeout,
            "max_steps": self.max_steps,
            "attention_variants": list(self.attention_variants),
        }
