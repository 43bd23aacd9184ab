"""The wheel check's content test: a wheel without a kernel header (the bug that broke non-editable installs)
is caught; the tree's kernel build is what it hands the wheel. The full check (build, install into a clean venv,
run) is `make wheel-test`, part of `make test`."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("wheel_check", ROOT / "scripts" / "wheel_check.py")
wheel_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wheel_check)


def _wheel(tmp_path: Path, skip: set[str]) -> Path:
    path = tmp_path / "kvcore-0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for src, dest in wheel_check.DATA.items():
            for p in src.iterdir():
                if p.is_file() and p.name not in skip:
                    z.writestr(f"{dest}/{p.name}", p.read_bytes())
    return path


def test_a_complete_wheel_passes(tmp_path):
    assert wheel_check.missing_files(_wheel(tmp_path, set())) == []


def test_a_wheel_without_the_kernel_header_fails(tmp_path):
    assert (ROOT / "kvcore" / "kernels" / "csrc" / "isa.h").is_file()
    assert wheel_check.missing_files(_wheel(tmp_path, {"isa.h"})) == ["kvcore/kernels/csrc/isa.h"]


def test_pyproject_ships_every_kernel_file_type():
    """Every suffix under csrc/ is named in pyproject's package-data, so a new header kind cannot be left out."""
    text = (ROOT / "pyproject.toml").read_text()
    for suffix in {p.suffix for p in (ROOT / "kvcore" / "kernels" / "csrc").iterdir()}:
        assert f'"kernels/csrc/*{suffix}"' in text


def test_the_trees_kernel_build_is_copied_into_the_wheels_cache(tmp_path, monkeypatch):
    """What the installed wheel finds under the key of its own sources (a path-free key: test_cache_trust.py)."""
    import kvcore.kernels.cpu_kernels as ck
    from kvcore.paths import verify_entry

    if ck.kernel_reasons():
        pytest.skip("; ".join(ck.kernel_reasons()))
    assert wheel_check.seed_kernels(tmp_path)
    [entry] = (tmp_path / "kernels").iterdir()
    assert entry.name == Path(ck.load_kernels()).parent.name and verify_entry(entry)
    monkeypatch.setattr(ck, "kernels_built", lambda: False)
    assert not wheel_check.seed_kernels(tmp_path / "none") and not (tmp_path / "none").exists()
