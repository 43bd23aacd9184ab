"""Decode steps with each of the post-head operators against the ATen ops they replaced, alternating in one process.

    python benchmarks/ab/step_overhead_ab.py                 # kvcore's default configuration, 1 thread, 40 pairs
    python benchmarks/ab/step_overhead_ab.py --pairs 60 --context 256

Each comparison runs pairs of engine steps of one request, the replaced ops patched back in for one step of each
pair ("before") and not for the other ("after"), so both decode at about the same context and a shared machine
slows them alike. The changes:

* ``head``: the int4 head writes float32 logits (``rescore_candidates_float``) / its bfloat16 logits, then ``.float()``;
* ``finite``: the backend check's flag as ``kvcore::all_finite`` / two sums, an add, ``isfinite`` and a read;
* ``argmax``: greedy decoding's argmax as ``kvcore::argmax_rows`` / the blocked ``amax``, ``argmax``, ``index`` ops;
* ``eos``: ``ignore_eos`` as one ``index_fill_`` / an indexing assignment;
* ``rows``: the token table's kept rows (the step's embedding, the head's candidates) gathered and decoded in one
  call (``q8_0_kept_rows``) / NumPy's gather from the kept rows, then ``q8_0_rows``;
* ``plan``: the sdpa / cpu_decode plan's cache rows of the step's tokens from the host lists in one tensor / as
  ``floor_divide``, ``mul``, ``add`` and indexing on the metadata's tensors;
* ``rope``: the step's RoPE rows as ``index_select`` / advanced indexing and ``[:, None, :]``;
* ``all``: every one of them at once.

Figures are this thread's CPU time with ``--threads 1`` (the default), medians over the pairs, with the median of
the pairs' differences (before - after).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.backends.sdpa import SDPABackend, SDPAPlan
from kvcore.engine.forward import Forward
from kvcore.execution import backend_check
from kvcore.loaders import gguf_blocks
from kvcore.model.lm_head import RescoredInt4Head
from kvcore.model.rope import RotaryEmbedding
from kvcore.sampling import processors

_HEAD_CALL = RescoredInt4Head.__call__
_SUPPRESS_EOS = Forward.suppress_eos


def _old_eos(self, reqs, logits):
    """What ``suppress_eos`` did before where every row ignores EOS (other batches: unchanged)."""
    eos = self.engine.eos_token_ids
    if not (eos and all(r.params.ignore_eos for r in reqs)):
        return _SUPPRESS_EOS(self, reqs, logits)
    cols = self.__dict__.get("_old_eos_columns")
    if cols is None:
        cols = self._old_eos_columns = torch.tensor(sorted(eos), device=logits.device)
    logits[:, cols] = float("-inf")


def _old_plan(self, meta, cache):
    """SDPABackend.plan with the tokens' cache rows as tensor ops (before)."""
    num_layers, _, num_kv_heads, max_len, _ = cache.storage_shape()
    token_rows = (meta.slot_mapping // cache.block_size) * (num_kv_heads * max_len) + meta.positions  # [T]
    rows = (self._row_bases(cache, meta.positions.device) + token_rows[None, :, None]).view(num_layers, -1)
    slots = meta.slots
    if not (meta.is_decode and slots == list(range(slots[0], slots[0] + len(slots)))):
        return SDPAPlan(meta, rows, None)
    windows = {layer.sliding_window for layer in meta.layers} - {None}
    return SDPAPlan(meta, rows, slots[0], meta.max_seq_len, self._decode_mask(meta, cache.spec.dtype),
                    {w: self._window_mask(meta, w) for w in windows})


def _old_tables(self, positions, dtype):
    """RotaryEmbedding.tables' eager rows by advanced indexing (before)."""
    cos, sin = self._full_tables(dtype)
    return cos[positions][:, None, :], sin[positions][:, None, :]


def _old_finite(out0, logits):
    return bool((out0.sum() + logits.sum()).isfinite())


@contextlib.contextmanager
def _before(change: str):
    """The replaced ops patched back in for the ``change`` ("all": every one)."""
    undo = []

    def patch(owner, name, value):
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    if change in ("head", "all"):
        patch(RescoredInt4Head, "__call__", lambda self, hidden, widen=False: _HEAD_CALL(self, hidden))
    if change in ("finite", "all"):
        patch(backend_check, "_all_finite", _old_finite)
    if change in ("argmax", "all"):
        patch(processors, "kernels_loaded", lambda: False)
    if change in ("eos", "all"):
        patch(Forward, "suppress_eos", _old_eos)
    if change in ("plan", "all"):
        patch(SDPABackend, "plan", _old_plan)
    if change in ("rope", "all"):
        patch(RotaryEmbedding, "tables", _old_tables)
    if change in ("rows", "all"):
        patch(gguf_blocks, "FileRows", type("NoNativeLookup", (), {}))  # no table is one: the NumPy path
    try:
        yield
    finally:
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--changes", default="head,finite,argmax,eos,rows,plan,rope,all")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    changes = args.changes.split(",")
    engine = Engine.from_pretrained("smollm2", EngineConfig(max_model_len=args.context + 2 * args.pairs + 64))
    prompt = [(7 * i) % 40000 + 100 for i in range(args.context)]
    params = SamplingParams(max_new_tokens=2 * args.pairs + 8, ignore_eos=True)
    engine.generate([prompt[:32]], SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up
    config = engine.config
    print(f"{config.backend} {config.dtype} {config.weights} weights, {config.lm_head} head, context {args.context}, "
          f"{torch.get_num_threads()} threads, {'thread CPU' if clock is time.thread_time else 'wall'} time, "
          f"medians of {args.pairs} pairs (ms per step):")
    with torch.inference_mode():
        for change in changes:
            engine.add_request(prompt, params)
            for _ in range(4):  # the prefill, then a few decode steps
                engine.step()
            times: dict[bool, list[float]] = {True: [], False: []}
            for i in range(args.pairs):
                for before in ((True, False) if i % 2 else (False, True)):  # alternate which goes first
                    with _before(change) if before else contextlib.nullcontext():
                        start = clock()
                        engine.step()
                        times[before].append(clock() - start)
            while engine.has_unfinished():
                engine.step()
            old, new = (statistics.median(times[k]) * 1e3 for k in (True, False))
            saved = statistics.median(a - b for a, b in zip(times[True], times[False])) * 1e3
            print(f"  {change:7s} before {old:6.2f}  after {new:6.2f}  saved {saved:5.2f} (median of the pairs' "
                  f"differences)")


if __name__ == "__main__":
    main()
