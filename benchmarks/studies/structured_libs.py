"""Which grammar library kvcore's constrained decoding uses: per-token cost of computing the allowed-token
mask and advancing the matcher on the embedded SmolLM2's tokenizer (49152 tokens), for llguidance, xgrammar
and outlines-core, on the same JSON schema and the same valid answer (best of ``--reps``).

    pip install --target /tmp/grammar-libs --no-deps llguidance==1.9.1 xgrammar==0.2.8 outlines-core==0.2.14 \\
        apache-tvm-ffi
    PYTHONPATH=/tmp/grammar-libs python benchmarks/studies/structured_libs.py

xgrammar needs transformers, triton, pydantic and apache-tvm-ffi at run time (installed here without its
declared dependencies: transformers comes from the dev extra); outlines-core compiles only regular
expressions (a JSON schema becomes one), no context-free grammar; llguidance has no dependencies.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvcore.loaders import load_model

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
          "age": {"type": "integer", "minimum": 0, "maximum": 120},
          "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 4}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["a", "ccc", "bb"]}, separators=(",", ":"))


def bench(name, make, mask, accept, ids, reps):
    start = time.perf_counter()
    make()
    first = time.perf_counter() - start
    best = float("inf")
    for _ in range(reps):
        m = make()
        start = time.perf_counter()
        for t in ids:
            mask(m)
            assert accept(m, t) is not False, f"{name} refused token {t}"
        best = min(best, (time.perf_counter() - start) / len(ids))
    print(f"{name}: first matcher {first * 1e3:.1f} ms, mask + advance {best * 1e6:.0f} us/token")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    tokenizer = load_model("smollm2").tokenizer
    backend, vocab, eos = tokenizer.backend, tokenizer.vocab_size, tokenizer.eos_token_ids[0]
    ids = backend.encode(ANSWER, add_special_tokens=False).ids
    print(f"{len(ids)} tokens, vocabulary {vocab}, {torch.get_num_threads()} threads")

    import llguidance
    import llguidance.torch as lt

    llt = llguidance.LLTokenizer(backend.to_str(), eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    bitmask = lt.allocate_token_bitmask(1, vocab)
    bench("llguidance 1.9.1", lambda: llguidance.LLMatcher(llt, grammar),
          lambda m: lt.fill_next_token_bitmask(m, bitmask), lambda m, t: m.consume_token(t), ids, args.reps)

    import xgrammar as xgr

    info = xgr.TokenizerInfo([backend.id_to_token(i) for i in range(vocab)], xgr.VocabType.BYTE_LEVEL,
                             vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    compiled = []

    def xg_make():
        if not compiled:
            compiled.append(compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                         separators=(",", ":")))
        return xgr.GrammarMatcher(compiled[0])

    xbitmask = xgr.allocate_token_bitmask(1, vocab)
    bench("xgrammar 0.2.8", xg_make, lambda m: m.fill_next_token_bitmask(xbitmask), lambda m, t: m.accept_token(t),
          ids, args.reps)

    import outlines_core

    start = time.perf_counter()
    tokens: dict[str, list[int]] = {}
    for i in range(vocab):
        if i != eos:
            tokens.setdefault(backend.id_to_token(i), []).append(i)
    index = outlines_core.Index(outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA)),
                                outlines_core.Vocabulary(eos, tokens))
    print(f"outlines-core: index built in {time.perf_counter() - start:.2f} s (once per schema)")
    obitmask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    bench("outlines-core 0.2.14", lambda: outlines_core.Guide(index),
          lambda m: m.write_mask_into(obitmask.data_ptr(), obitmask.numel(), 4), lambda m, t: m.advance(t),
          ids, args.reps)


if __name__ == "__main__":
    main()
