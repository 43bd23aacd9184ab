"""Caches that trust only the user (kvcore/paths.py, model_cache.py, cpu_kernels.py): folders others can
write or that are links are refused with a line naming them, only kvcore's own entries are ever deleted, a
damaged entry is rebuilt, an unwritable cache means running without it, and kernel builds fail typed.

The kernel tests replace the compiler run with a stand-in (a real build takes minutes on a small machine)
except where a real compiler call is the point; tests with another owner need root (chown), else skip."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch
from tiny_checkpoints import build_hf, write_gguf

import kvcore.kernels.cpu_kernels as ck
import kvcore.loaders.model_cache as mc
from kvcore.errors import BackendUnavailableError, CacheTrustError, KernelBuildError
from kvcore.paths import MARKER, is_entry, private_dir, remove_entry, verify_entry, write_entry

OTHER_UID = 65534  # nobody
as_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")


@pytest.fixture
def root(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("KVCORE_CACHE_DIR", str(path))
    monkeypatch.setenv("KVCORE_MODEL_CACHE", "1")
    return path


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# -- folders and entries -------------------------------------------------------------------------------

def test_folders_are_made_private(root):
    private_dir(root / "kernels" / "x", root)
    assert [mode(p) for p in (root, root / "kernels", root / "kernels" / "x")] == [0o700] * 3


@pytest.mark.parametrize("bad", ["world-writable", "group-writable", "symlink", "file"])
def test_an_untrusted_folder_is_refused_by_name(root, tmp_path, bad):
    root.mkdir(mode=0o700)
    kernels = root / "kernels"
    if bad == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        kernels.symlink_to(tmp_path / "elsewhere")
    elif bad == "file":
        kernels.write_text("")
    else:
        kernels.mkdir()
        kernels.chmod(0o777 if bad == "world-writable" else 0o770)
    with pytest.raises(CacheTrustError) as info:
        private_dir(kernels, root)
    assert str(kernels) in str(info.value) and "\n" not in str(info.value)


def test_a_world_writable_root_is_refused(root):
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(CacheTrustError, match="others can write it"):
        private_dir(root / "models", root)


@as_root
def test_a_folder_of_another_user_is_refused(root):
    (root / "kernels").mkdir(parents=True, mode=0o700)
    os.chown(root / "kernels", OTHER_UID, OTHER_UID)
    with pytest.raises(CacheTrustError, match=f"uid {OTHER_UID}"):
        private_dir(root / "kernels", root)


def test_entries_carry_checksums_and_a_flipped_byte_is_caught(root):
    folder = private_dir(root / "things", root)
    entry = write_entry(folder, "e", lambda p: (p / "data").write_bytes(bytes(range(256)) * 8))
    assert is_entry(entry) and verify_entry(entry)
    assert set(json.loads((entry / MARKER).read_text())) == {"data"}
    data = bytearray((entry / "data").read_bytes())
    data[1000] ^= 1
    (entry / "data").write_bytes(data)
    with pytest.warns(RuntimeWarning, match="damaged"):
        assert not verify_entry(entry)
    assert not entry.exists()  # deleted: the caller rebuilds it


def _rewrite(path: Path, content: bytes) -> None:
    """``path`` written again, its modification time moved on (file times tick coarser than two quick writes)."""
    before = os.stat(path).st_mtime_ns
    path.write_bytes(content)
    os.utime(path, ns=(before, max(os.stat(path).st_mtime_ns, before + 1_000_000)))


def test_a_file_of_a_new_identity_is_hashed_again_and_kept_when_whole(root):
    """Rewritten with the same bytes (a new identity), a file with a checksum is hashed again and kept; one byte
    changed, it is damaged."""
    folder = private_dir(root / "things", root)
    content = bytes(range(256)) * 9
    entry = write_entry(folder, "e", lambda p: (p / "data").write_bytes(content))
    _rewrite(entry / "data", content)
    assert verify_entry(entry)
    _rewrite(entry / "data", content[:-1] + b"\x00")
    with pytest.warns(RuntimeWarning, match="damaged"):
        assert not verify_entry(entry)


def test_an_entry_without_checksums_is_damaged_once_its_file_changes(root):
    """A model-sized entry is written without a checksum pass: its marker keeps identities only, so any change to a
    file (even a rewrite with the same bytes: nothing can tell) makes it damaged, never silently accepted."""
    folder = private_dir(root / "things", root)
    content = bytes(range(256)) * 4
    entry = write_entry(folder, "e", lambda p: (p / "data").write_bytes(content), checksums=False)
    assert set(json.loads((entry / MARKER).read_text())["data"]) == {"identity"}
    assert verify_entry(entry)
    _rewrite(entry / "data", content)
    with pytest.warns(RuntimeWarning, match="damaged"):
        assert not verify_entry(entry)


def test_only_marked_folders_are_ever_removed(root, tmp_path):
    folder = private_dir(root / "things", root)
    mine = folder / "my-finetune"
    mine.mkdir()
    (mine / "weights.bin").write_text("precious")
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / MARKER).write_text("{}")
    (folder / "link").symlink_to(tmp_path / "target")  # a link to a marked folder is still no entry
    assert not remove_entry(mine) and not remove_entry(folder / "link")
    assert (mine / "weights.bin").read_text() == "precious" and (tmp_path / "target").is_dir()


# -- prepared models -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    pytest.importorskip("transformers")
    return write_gguf(build_hf("llama"), "llama", tmp_path_factory.mktemp("gguf") / "llama.gguf")


def test_a_symlinked_models_folder_is_refused(root, tmp_path, gguf):
    root.mkdir(mode=0o700)
    (tmp_path / "other").mkdir(mode=0o700)
    (root / "models").symlink_to(tmp_path / "other")
    with pytest.raises(CacheTrustError, match=f"{root / 'models'}: it is a symbolic link"):
        mc.load_pretrained(str(gguf))
    assert not list((tmp_path / "other").iterdir())


def test_a_world_writable_cache_is_refused_for_models(root, gguf):
    (root / "models").mkdir(parents=True)
    (root / "models").chmod(0o777)
    with pytest.raises(CacheTrustError, match="others can write it"):
        mc.load_pretrained(str(gguf))


def test_a_user_folder_in_models_survives_eviction_and_clear(root, gguf):
    mine = root / "models" / "my-finetune"
    mine.mkdir(parents=True)
    (mine / "model.safetensors").write_text("mine")
    for length in range(32, 32 + mc.MAX_ENTRIES + 2):
        mc.load_pretrained(str(gguf), max_model_len=length)
    entries = [p for p in (root / "models").iterdir() if is_entry(p)]
    assert len(entries) == mc.MAX_ENTRIES
    assert mc.clear() == mc.MAX_ENTRIES
    assert (mine / "model.safetensors").read_text() == "mine"
    assert [p.name for p in (root / "models").iterdir()] == ["my-finetune"]


def test_a_flipped_byte_in_a_model_entry_is_rebuilt(root, gguf):
    fresh, _ = mc.load_pretrained(str(gguf), use_cache=False)
    mc.load_pretrained(str(gguf))
    (entry,) = [p for p in (root / "models").iterdir() if is_entry(p)]
    weights = entry / "model.pt"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x40  # inside the tensor data: torch.load alone would not notice
    weights.write_bytes(data)
    with pytest.warns(RuntimeWarning, match="damaged"):
        model, _ = mc.load_pretrained(str(gguf))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert verify_entry(entry)  # written again, whole
    again, _ = mc.load_pretrained(str(gguf))
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), fresh.state_dict().values()))


def test_a_full_disk_runs_without_the_model_cache(root, gguf, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mc.torch, "save", full)
    with pytest.warns(RuntimeWarning, match="No space left on device.*running without it"):
        model, tok = mc.load_pretrained(str(gguf))
    assert tok.encode("fox") and model.config.num_hidden_layers == 2
    assert not [p for p in (root / "models").iterdir()]  # no half-written entry is left


# -- kernel libraries ------------------------------------------------------------------------------------

@pytest.fixture
def fake_build(monkeypatch):
    """The compiler run replaced by writing a stand-in library; what was built and loaded is recorded."""
    calls = {"built": 0, "loaded": []}

    def build(cxx, sources, folder):
        calls["built"] += 1
        (folder / ck._LIBRARY).write_bytes(b"\x7fELF stand-in" * 100)
        return folder / ck._LIBRARY

    monkeypatch.setattr(ck, "_build", build)
    monkeypatch.setattr(ck, "_load", lambda library, entry: calls["loaded"].append(library.read_bytes()))
    return calls


def kernels_entry(root: Path) -> Path:
    return root / "kernels" / ck._entry_name(ck.cxx_compiler(), [ck._CSRC / n for n in ck._SOURCES])


def test_kernels_are_stored_verified_and_rebuilt_when_damaged(root, fake_build):
    ck._cached_or_built("g++", [], root / "kernels", "k")
    assert fake_build["built"] == 1 and mode(root / "kernels" / "k") == 0o700
    ck._cached_or_built("g++", [], root / "kernels", "k")
    assert fake_build["built"] == 1 and len(fake_build["loaded"]) == 2  # the second start only loads
    library = root / "kernels" / "k" / ck._LIBRARY
    library.write_bytes(library.read_bytes()[:50])  # truncated
    with pytest.warns(RuntimeWarning, match="damaged"):
        ck._cached_or_built("g++", [], root / "kernels", "k")
    assert fake_build["built"] == 2 and fake_build["loaded"][-1] == b"\x7fELF stand-in" * 100


@pytest.mark.parametrize("trouble", ["read-only", "full"])
def test_an_unwritable_kernel_cache_builds_for_this_process(root, tmp_path, fake_build, monkeypatch, trouble):
    if trouble == "read-only":
        monkeypatch.setenv("KVCORE_CACHE_DIR", str(tmp_path / "file"))
        (tmp_path / "file").write_text("")  # no folder can be made under it

        def where():
            return tmp_path / "file"
    else:
        def where():
            return root

        def full(*args):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(ck.shutil, "copyfile", full)
    with pytest.warns(RuntimeWarning, match="kernel cache.*running without it"):
        ck._cached_or_built("g++", [], where() / "kernels", "k")
    assert fake_build["built"] == 1 and fake_build["loaded"] == [b"\x7fELF stand-in" * 100]


@as_root
def test_a_planted_kernel_library_is_never_loaded(root, tmp_path):
    """Another user plants a library (whose constructor would leave a file) with a valid marker."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the planted library")
    proof = tmp_path / "constructor-ran"
    src = tmp_path / "evil.c"
    src.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void f(void) {{'
                   f' FILE *p = fopen("{proof}", "w"); if (p) fclose(p); }}\n')
    entry = kernels_entry(root)
    entry.mkdir(parents=True)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(entry / ck._LIBRARY), str(src)], check=True)
    sums = {ck._LIBRARY: hashlib.sha256((entry / ck._LIBRARY).read_bytes()).hexdigest()}
    (entry / MARKER).write_text(json.dumps(sums))
    for planted in (root, root / "kernels"):
        planted.chmod(0o700)
    for case in ("other owner", "world-writable folder"):
        if case == "other owner":
            for path in (entry, entry / ck._LIBRARY, entry / MARKER):
                os.chown(path, OTHER_UID, OTHER_UID)
            entry.chmod(0o755)
        else:
            for path in (entry, entry / ck._LIBRARY, entry / MARKER):
                os.chown(path, 0, 0)
            (root / "kernels").chmod(0o777)
        with pytest.raises(CacheTrustError) as info:
            ck.load_kernels.__wrapped__()
        assert str(root / "kernels") in str(info.value) and "\n" not in str(info.value)
        assert not proof.exists()


def test_the_kernel_entry_is_keyed_by_the_sources_texts_not_their_folder(tmp_path, monkeypatch):
    """A clone, a worktree and the installed wheel of the same sources (and torch installs of one version)
    share one build; a changed header still makes a new entry."""
    here = ck._entry_name("g++", [ck._CSRC / n for n in ck._SOURCES])
    copy = tmp_path / "clone" / "csrc"
    shutil.copytree(ck._CSRC, copy)
    monkeypatch.setattr(ck, "_CSRC", copy)
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "venv" / "torch" / "__init__.py"))
    assert ck._command("g++", [copy / "isa.cpp"], Path("o.so")) != ck._command("g++", [Path("isa.cpp")], Path("o.so"))
    assert ck._entry_name("g++", [copy / n for n in ck._SOURCES]) == here
    (copy / "isa.h").write_text((copy / "isa.h").read_text() + "\n")
    assert ck._entry_name("g++", [copy / n for n in ck._SOURCES]) != here


def test_cxx_may_hold_a_command_with_arguments(monkeypatch):
    monkeypatch.setenv("CXX", "env g++")
    assert ck._command(ck.cxx_compiler(), [Path("a.cpp")], Path("o.so"))[:3] == ["env", "g++", "-O3"]
    monkeypatch.setenv("CXX", "no-such-compiler-kvcore --flag")
    assert any("CXX='no-such-compiler-kvcore --flag' names no program" in r for r in ck.kernel_reasons())
    with pytest.raises(BackendUnavailableError, match="names no program"):
        ck.load_kernels.__wrapped__()


def test_a_compiler_that_cannot_run_is_a_typed_error(tmp_path):
    with pytest.raises(KernelBuildError, match=r"cannot run the compiler: .*; CXX must name a C\+\+20 compiler"):
        ck._build(str(tmp_path / "missing-g++"), [], tmp_path)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_a_failed_build_through_a_wrapper_is_one_line_with_the_first_error(monkeypatch, tmp_path):
    (tmp_path / "bad.cpp").write_text("int main( {\n")
    monkeypatch.setenv("CXX", "env g++")
    with pytest.raises(KernelBuildError) as info:
        ck._build(ck.cxx_compiler(), [tmp_path / "bad.cpp"], tmp_path)
    message = str(info.value)
    assert message.startswith("building kvcore's CPU kernels failed (env g++): ") and "bad.cpp:1" in message
    assert "error" in message and "CXX must name" in message and "\n" not in message
