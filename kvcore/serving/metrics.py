"""Serving metrics in the Prometheus text exposition format (version 0.0.4), without a client library.

Counters and histograms are updated from the engine loop and the HTTP handlers (so every update takes
a lock); gauges are read from the engine loop's latest :class:`~kvcore.serving.async_engine.ServingStats`
when ``/metrics`` is scraped.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence

__all__ = ["Counter", "Histogram", "ServingMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
    return "{" + body + "}" if body else ""


def _number(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**53 else repr(float(x))


class Counter:
    """A monotonically increasing count, optionally split by label values (``.labels(k=v).inc()``)."""

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()) -> None:
        self.name, self.help, self.label_names = name, help_text, tuple(label_names)
        self._lock = threading.Lock()
        self._values: dict[tuple[str, ...], float] = {} if label_names else {(): 0.0}

    def labels(self, **labels: str) -> _Child:
        key = tuple(str(labels[n]) for n in self.label_names)
        return _Child(self, key)

    def inc(self, amount: float = 1.0, _key: tuple[str, ...] = ()) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        with self._lock:
            self._values[_key] = self._values.get(_key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(tuple(str(labels[n]) for n in self.label_names), 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        with self._lock:
            items = sorted(self._values.items())
        for key, v in items:
            lines.append(f"{self.name}{_labels(zip(self.label_names, key))} {_number(v)}")
        return lines


class _Child:
    def __init__(self, counter: Counter, key: tuple[str, ...]) -> None:
        self._counter, self._key = counter, key

    def inc(self, amount: float = 1.0) -> None:
        self._counter.inc(amount, self._key)


class Histogram:
    """Observations counted into cumulative ``le`` buckets, with their sum and count."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name, self.help = name, help_text
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._lock = threading.Lock()
        self._counts = [0] * len(self.buckets)
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        with self._lock:
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    self._counts[i] += 1
                    break
            self._sum += value
            self._count += 1

    @property
    def count(self) -> int:
        return self._count

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self._lock:
            counts, total, count = list(self._counts), self._sum, self._count
        cumulative = 0
        for bound, c in zip(self.buckets, counts):
            cumulative += c
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        lines += [f"{self.name}_sum {_number(total)}", f"{self.name}_count {count}"]
        return lines


def _gauge(name: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {_number(value)}"]


# Latency buckets in seconds: TTFT spans a cached short prompt on a GPU to a long prompt on a small CPU.
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


#: the engine's own counters (``Engine.stats``) that /metrics reports: (field, metric name, help)
_ENGINE_COUNTERS = (
    ("num_steps", "kvcore_engine_steps_total", "Forward calls (engine steps)"),
    ("num_prefill_tokens", "kvcore_prefill_tokens_total", "Prompt tokens computed (recomputation included)"),
    ("num_cached_tokens", "kvcore_prefix_cache_hit_tokens_total",
     "Prompt tokens not computed because their KV was cached (prefix cache, shared n>1 prompts)"),
    ("num_preemptions", "kvcore_preemptions_total", "Requests preempted for KV-cache room (recomputed later)"),
    ("num_spec_steps", "kvcore_spec_verifications_total",
     "Speculative decoding: per request, verification steps that scored draft tokens"),
    ("num_draft_tokens", "kvcore_spec_draft_tokens_total", "Speculative decoding: draft tokens scored"),
    ("num_accepted_tokens", "kvcore_spec_accepted_tokens_total",
     "Speculative decoding: draft tokens kept (acceptance rate = accepted / draft)"),
)


class ServingMetrics:
    """Everything ``GET /metrics`` reports (names prefixed ``kvcore_``)."""

    def __init__(self) -> None:
        self.http_requests = Counter(
            "kvcore_http_requests_total", "HTTP requests answered, by endpoint and status code", ("endpoint", "status")
        )
        self.request_finished = Counter(
            "kvcore_requests_total",
            "Generation requests that ended, by outcome (ok, error, abort)",
            ("status",),
        )
        self.generation_tokens = Counter("kvcore_generation_tokens_total", "Tokens generated")
        self.prompt_tokens = Counter("kvcore_prompt_tokens_total", "Prompt tokens of finished requests")
        self.time_to_first_token = Histogram(
            "kvcore_time_to_first_token_seconds", "Submission to first generated token", _TTFT_BUCKETS
        )
        self.time_per_output_token = Histogram(
            "kvcore_time_per_output_token_seconds", "Mean time between generated tokens of a request", _TPOT_BUCKETS
        )
        self.e2e_latency = Histogram("kvcore_e2e_request_latency_seconds", "Submission to end of request", _E2E_BUCKETS)

    def render(self, stats) -> str:
        """The exposition text; ``stats`` is the engine loop's latest ``ServingStats``."""
        lines: list[str] = []
        for metric in (
            self.http_requests,
            self.request_finished,
            self.generation_tokens,
            self.prompt_tokens,
            self.time_to_first_token,
            self.time_per_output_token,
            self.e2e_latency,
        ):
            lines += metric.render()
        counters = dict(stats.engine_counters)
        for key, name, help_text in _ENGINE_COUNTERS:
            if key in counters:
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {_number(counters[key])}"]
        lines += _gauge("kvcore_num_requests_running", "Requests in the running batch", stats.num_running)
        lines += _gauge("kvcore_num_requests_waiting", "Requests queued, not yet running", stats.num_waiting)
        lines += _gauge("kvcore_kv_blocks_total", "KV-cache blocks in the pool", stats.num_kv_blocks_total)
        lines += _gauge("kvcore_kv_blocks_in_use", "KV-cache blocks held by requests", stats.num_kv_blocks_used)
        usage = stats.num_kv_blocks_used / stats.num_kv_blocks_total if stats.num_kv_blocks_total else 0.0
        lines += _gauge("kvcore_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0-1)", usage)
        return "\n".join(lines) + "\n"
