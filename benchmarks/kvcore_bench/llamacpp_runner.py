"""llama.cpp through ``llama-cpp-python``'s low-level API: greedy generation of token-id prompts, timed per token.

Batched requests use llama.cpp's own batched decoding (one ``llama_decode`` per step carrying every
sequence's token under its own ``seq_id``, as llama.cpp's ``batched`` example does), not sequential runs.
Greedy = argmax of each sequence's logits row (numpy), the same rule kvcore applies.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["LlamaCppRunner", "llama_cpp_version"]


def llama_cpp_version() -> str | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    return getattr(llama_cpp, "__version__", "?")


class LlamaCppRunner:
    """One model and one context of ``n_ctx`` tokens per sequence for up to ``max_seqs`` sequences.

    :param path: the GGUF file (the same one kvcore loads).
    :param threads: threads for both decode and prompt processing.
    """

    def __init__(self, path: str | Path, threads: int, n_ctx: int, max_seqs: int, n_batch: int = 2048) -> None:
        import llama_cpp as lc

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's load/context chatter
        self.lc = lc
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab_size = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx * max_seqs
        cparams.n_batch = n_batch
        cparams.n_ubatch = min(512, n_batch)
        cparams.n_seq_max = max_seqs
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_batch = n_batch
        self.max_seqs = max_seqs
        self.batch = lc.llama_batch_init(n_batch, 0, 1)
        self.system_info = lc.llama_print_system_info().decode(errors="replace").strip()

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def _clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of ``(token, position, seq_id, wants_logits)`` entries."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(entries)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, row: int) -> int:
        ptr = self.lc.llama_get_logits_ith(self.ctx, row)
        logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.vocab_size,))
        return int(logits.argmax())

    def generate(
        self, prompts: Sequence[Sequence[int]], new_tokens: int
    ) -> tuple[list[float], list[list[float]], list[list[int]]]:
        """Greedy ``new_tokens`` per prompt, all prompts concurrently.

        :returns: ``(ttft_s per prompt, token times per prompt (perf_counter), token ids per prompt)``;
            the prompts are processed in chunks of ``n_batch`` tokens, every sequence's first token
            after all prompts are in (as kvcore's unchunked prefill of one batch)."""
        if len(prompts) > self.max_seqs:
            raise ValueError(f"{len(prompts)} prompts for a context of {self.max_seqs} sequences")
        self._clear()
        start = time.perf_counter()
        entries = [(t, p, s, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)]
        tokens: list[list[int]] = [[] for _ in prompts]
        times: list[list[float]] = [[] for _ in prompts]
        for lo in range(0, len(entries), self.n_batch):
            chunk = entries[lo : lo + self.n_batch]
            self._decode(chunk)
            for i, (_, _, seq, wants) in enumerate(chunk):
                if wants:  # read now: the next chunk's decode overwrites the logits
                    tokens[seq].append(self._argmax(i))
        now = time.perf_counter()
        for seq in range(len(prompts)):
            times[seq].append(now)
        ttfts = [now - start] * len(prompts)
        for step in range(1, new_tokens):
            batch = [(tokens[s][-1], len(prompts[s]) + step - 1, s, True) for s in range(len(prompts))]
            self._decode(batch)
            for s in range(len(prompts)):
                tokens[s].append(self._argmax(s))
            now = time.perf_counter()
            for s in range(len(prompts)):
                times[s].append(now)
        return ttfts, times, tokens
