"""Generate text with the example plugins, chosen by a kvcore config file (``kvcore.toml`` next to this script).

::

    python examples/kvcore-example-backend/generate.py "The history of the printing press begins"
    python examples/kvcore-example-backend/generate.py --config my.toml --max-new-tokens 16 "Once upon a time"

The file names the backend, KV cache and sampler (``backend``, ``kv_cache``, ``sampler``) and their
constructor options (``[backends.<name>]``, ``[kv_caches.<name>]``, ``[samplers.<name>]``); kvcore finds
the classes through this package's ``kvcore`` entry point, so the package must be installed
(``pip install -e examples/kvcore-example-backend``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvcore import Engine, load_settings
from kvcore.errors import KVCoreError

DEFAULT_CONFIG = Path(__file__).with_name("kvcore.toml")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompt", help="text to continue")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="kvcore TOML config (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="overrides the config file")
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args.config, max_new_tokens=args.max_new_tokens)
        start = time.perf_counter()
        engine = Engine.from_settings(settings)
        loaded = time.perf_counter()
        [result] = engine.generate([args.prompt], settings.sampling)
        done = time.perf_counter()
    except KVCoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if result.error is not None:
        print(f"error: {result.error}", file=sys.stderr)
        return 1
    print(args.prompt + result.text)
    print()
    backends = engine.prefill_backend.name
    if engine.decode_backend is not engine.prefill_backend:
        backends = f"{backends} (prefill) / {engine.decode_backend.name} (decode)"
    print(f"backend:  {backends}")
    print(f"kv cache: {engine.cache.name} ({engine.cache.bytes_per_token} bytes per token)")
    print(f"sampler:  {engine.sampler.name}")
    num_tokens = len(result.token_ids)
    print(f"model {settings.model} loaded in {loaded - start:.1f} s; {num_tokens} tokens in {done - loaded:.1f} s "
          f"({result.finish_reason.value})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
