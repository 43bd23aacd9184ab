"""`kvcore serve` with one test plugin: a prefill backend that turns a marked request's keys and values into NaN.

No input a real client can send makes a float model return NaN (sampling settings are validated, weights are
checked finite on load), yet a NaN from a backend, a kernel or bad weights is what must stay inside its own
request: fail it, leave nothing in the KV slot it held, touch no other request. So this server runs the
backend it is told to (``--nan-inner``, default ``cpu_decode``: SmolLM2's default on CPU) for every request,
and for a *marked* one also feeds NaN keys and values into it: the cache is written with NaN and the
attention output turns NaN, as a request whose model state went bad would; the rows its earlier prompt chunks
wrote are overwritten with NaN too, so the slot or blocks it leaves hold NaN over its whole length. A request is
marked by its length: a prefill chunk that brings its sequence to exactly ``--nan-prompt-tokens`` tokens. The load test
(``load_test.py --nan-fraction``) sends such prompts and keeps every other request shorter than that.

    python benchmarks/studies/nan_server.py --nan-prompt-tokens 256 serve --model smollm2 --port 0

Everything after the two options is `kvcore serve`'s command line; the server's decode backend is the inner
backend itself, so the decode path is the default one.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

from kvcore.cli import main
from kvcore.hookspecs import hookimpl
from kvcore.interfaces.metadata import AttentionMetadata
from kvcore.plugins.registry import get_registry

NAME = "nan-marked"


def marked_backend(inner: type, num_tokens: int) -> type:
    """A subclass of backend class ``inner`` named ``nan-marked``: every sequence that a call brings to exactly
    ``num_tokens`` tokens gets NaN keys and values, in this call's rows (before ``inner`` writes and attends them)
    and in the rows its earlier prompt chunks wrote to the cache, so that its whole length is poisoned."""

    class NaNMarked(inner):
        name = NAME
        description = f"{inner.name}, with NaN K/V for a sequence reaching {num_tokens} tokens (load test only)"

        def plan(self, meta, cache):
            starts = [0]
            for n in meta.query_lens:
                starts.append(starts[-1] + n)
            marked = [i for i, (c, n) in enumerate(zip(meta.context_lens, meta.query_lens)) if c + n == num_tokens]
            self._rows = [(starts[i], starts[i + 1]) for i in marked]  # in this call's packed [T] rows
            self._earlier = [earlier_rows(meta, i) for i in marked if meta.context_lens[i]]
            return super().plan(meta, cache)

        def decode_stack(self, plan, cache):
            return None if self._rows else super().decode_stack(plan, cache)

        def forward(self, layer_idx, q, k, v, cache, plan):
            if self._rows:  # k, v: [T, H_kv, D]
                k, v = k.clone(), v.clone()
                for start, end in self._rows:
                    k[start:end] = float("nan")
                    v[start:end] = float("nan")
                for rows in self._earlier:
                    nan = torch.full((rows.positions.numel(), *k.shape[1:]), float("nan"), dtype=k.dtype,
                                     device=k.device)
                    cache.write(layer_idx, nan, nan, rows.for_layer(layer_idx))
            return super().forward(layer_idx, q, k, v, cache, plan)

    return NaNMarked


def earlier_rows(meta: AttentionMetadata, i: int) -> AttentionMetadata:
    """``meta`` addressing the rows sequence ``i`` already holds (its positions ``[0, context_len)``), for a write."""
    size, table = meta.block_size, meta.block_tables[i]
    positions = range(meta.context_lens[i])
    slots = [table[p // size] * size + p % size for p in positions]
    return dataclasses.replace(meta, positions=torch.tensor(list(positions), device=meta.positions.device),
                               slot_mapping=torch.tensor(slots, device=meta.slot_mapping.device))


def serve(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nan-prompt-tokens", type=int, required=True, help="the length that marks a request")
    p.add_argument("--nan-inner", default="cpu_decode", help="the backend every request runs on")
    args, rest = p.parse_known_args(argv)
    registry = get_registry()
    backend = marked_backend(registry.get(args.nan_inner).cls, args.nan_prompt_tokens)

    class Plugin:
        @staticmethod
        @hookimpl
        def kvcore_register_backends(register):
            register(backend)

    registry.register_plugin(Plugin, name="nan_server")
    return main([*rest, "--prefill-backend", NAME, "--decode-backend", args.nan_inner])


if __name__ == "__main__":
    os.environ.setdefault("KVCORE_LOAD_PLUGINS", "")
    sys.exit(serve(sys.argv[1:]))
