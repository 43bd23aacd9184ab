"""``kvcore kernels``: whether kvcore's C++ CPU kernels can run here, and building them ahead of first use."""

from __future__ import annotations

import argparse
import json

from kvcore.kernels.cpu import cpu_features
from kvcore.kernels.cpu_kernels import (
    cxx_compiler,
    extension_reasons,
    int8_dot_isa,
    kernel_reasons,
    load_kernels,
    vector_isa,
)

__all__ = ["run_kernels"]


def run_kernels(args: argparse.Namespace) -> int:
    """``status`` reports; ``build`` builds (or finds the cached library) and reports. A build that cannot
    happen raises BackendUnavailableError with the reason (the CLI's exit code for an unavailable backend)."""
    library = load_kernels() if args.action == "build" else None
    info = {
        "cpu": cpu_features().model,
        "vector_isa": vector_isa(),
        "compiler": cxx_compiler() or None,
        "extensions": {f: not extension_reasons(f) for f in ("avx512_vnni", "avx512_bf16")},
        "int8_dot": int8_dot_isa(),  # what the int4a8 / gguf kernels multiply with (None: portable loops)
        "reasons": kernel_reasons(),
        "library": library,
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"cpu: {info['cpu']}")
    print(f"vector ISA: {info['vector_isa']}; extensions: "
          + ", ".join(f"{f} {'yes' if on else 'no'}" for f, on in info["extensions"].items()))
    print(f"int8 dot products: {info['int8_dot'] or 'portable loops'}")
    print(f"compiler: {info['compiler'] or 'none'}")
    if info["reasons"]:
        print("cannot build: " + "; ".join(info["reasons"]))
    if library:
        print(f"library: {library}")
    return 0
