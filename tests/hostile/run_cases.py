"""Child process of tests/e2e/test_hostile.py: run hostile corpus cases one after the other under a memory
limit and a per-case alarm, printing one JSON line per case.

    python tests/hostile/run_cases.py CORPUS_DIR CASE [CASE ...]

Before the first case the address space is capped at what the imports use plus :data:`MEMORY_LIMIT`, so
a case that tries to allocate more fails with MemoryError (reported, never a machine in swap); each case
gets :data:`CASE_TIMEOUT_S` seconds (SIGALRM). ``START name`` is printed before a case, so the parent can
name the case that hung should the process stop answering altogether.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_corpus  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import kvcore.loaders.gguf  # noqa: E402, F401  (imported up front: a permission case drops privileges)
import kvcore.loaders.hf  # noqa: E402, F401
from kvcore import errors  # noqa: E402
from kvcore.engine.config import EngineConfig  # noqa: E402
from kvcore.engine.core import Engine  # noqa: E402
from kvcore.interfaces.sampler import SamplingParams  # noqa: E402
from kvcore.loaders import load_model  # noqa: E402

MEMORY_LIMIT = 1 << 30  # bytes of address space a case may add
CASE_TIMEOUT_S = 20


class CaseTimeout(BaseException):
    """Raised by SIGALRM; a BaseException so no ``except Exception`` in the code under test swallows it."""


def _alarm(signum, frame):
    raise CaseTimeout()


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def _verify_tiny_weights(loaded) -> None:
    """Tensors of the corpus' tiny model arrive unchanged (Q/K rows are permuted by design: skipped)."""
    source = make_corpus.tiny_weights()
    pairs = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
             "model.norm.weight": "output_norm.weight", "model.layers.1.mlp.down_proj.weight": "blk.1.ffn_down.weight",
             "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight"}
    for canonical, gguf_name in pairs.items():
        np.testing.assert_array_equal(loaded.weights[canonical].numpy(), source[gguf_name], err_msg=canonical)


def _verify_hf_weights(loaded) -> None:
    for name, value in make_corpus.hf_weights().items():
        np.testing.assert_array_equal(loaded.weights[name].numpy(), value, err_msg=name)


VERIFY = {"tiny_weights": _verify_tiny_weights, "hf_weights": _verify_hf_weights}


def run(case: make_corpus.Case, path: Path) -> dict:
    # chmod 000 stops no root process: a permission case drops to the case's uid (effective only, so the
    # runner can take root back)
    drop = case.user is not None and os.geteuid() == 0
    if drop:
        os.seteuid(case.user)
    try:
        loaded = load_model(str(path))
    finally:
        if drop:
            os.seteuid(0)
    detail: dict = {}
    if case.op == "chat":
        text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        detail["chars"] = len(text)
    elif case.op == "generate":
        engine = Engine.from_pretrained(str(path), EngineConfig())
        [result] = engine.generate(["a th"], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
        detail["token_ids"] = list(result.token_ids)
        detail["max_model_len"] = engine.max_model_len
        if len(result.token_ids) != 4 or not all(0 <= t < loaded.config.vocab_size for t in result.token_ids):
            raise AssertionError(f"generated {result.token_ids}")
    if case.verify:
        VERIFY[case.verify](loaded)
    return detail


def main(argv: list[str]) -> int:
    root, names = Path(argv[0]), argv[1:]
    cases = make_corpus.all_cases()
    torch.set_num_threads(1)
    limit = _vm_size() + MEMORY_LIMIT
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGALRM, _alarm)
    for name in names:
        case = cases[name]
        path = next(p for p in (root / name).iterdir())
        print("START " + name, flush=True)
        start = time.perf_counter()
        record: dict = {"name": name}
        signal.alarm(CASE_TIMEOUT_S)
        try:
            record.update(outcome="ok", detail=run(case, path))
        except CaseTimeout:
            record.update(outcome="timeout")
        except errors.KVCoreError as exc:
            kinds = [k.__name__ for k in type(exc).__mro__]
            record.update(outcome="error", kinds=kinds, message=str(exc))
        except BaseException as exc:  # anything untyped is a finding: report it with its traceback
            record.update(outcome="untyped", kinds=[type(exc).__name__], message=str(exc)[:500],
                          traceback=traceback.format_exc()[-2000:])
        finally:
            signal.alarm(0)
        record["seconds"] = round(time.perf_counter() - start, 3)
        print("RESULT " + json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
