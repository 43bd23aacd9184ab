"""Where kvcore keeps its on-disk state (:func:`cache_root`), and cache folders that trust only the user:
kvcore loads code (its kernel library) and weights from them.

Rules, as ssh and pip apply them to their own files:

* every folder kvcore makes under the cache root is created mode 0700;
* a folder or file kvcore reads from there must be owned by the user (or root) and not writable by group
  or others, and must not be a symbolic link (checked with ``lstat``, never followed); otherwise
  :class:`~kvcore.errors.CacheTrustError` names the folder and how to fix it. The root itself may be
  a link (``~/.cache`` often is), its target is checked the same way;
* an *entry* is a folder kvcore wrote whole and renamed into place; it holds :data:`MARKER`, a JSON file with the
  identity (inode, size, modification time) each of its other files had when written and, for entries that keep them
  (the kernel library's), their SHA-256 checksums. Only folders with a marker are ever deleted (eviction, clearing,
  damage), so a user's own folder inside the cache survives. A file still of its identity is not read again (a model's
  weights are not hashed on every start); any other is hashed, and one whose checksum does not match, or that has
  none, makes the entry damaged: it is deleted and rebuilt.

A folder that cannot be created or written (read-only, full disk) is an ``OSError`` for the caller, who
then runs without the cache and says so in one warning line.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

from kvcore.errors import CacheTrustError

__all__ = ["cache_root", "MARKER", "private_dir", "check_trusted", "write_entry", "verify_entry", "is_entry",
           "remove_entry",
           "warn_no_cache"]


def cache_root() -> Path:
    """kvcore's on-disk cache: ``$KVCORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvcore``, else ``~/.cache/kvcore``."""
    root = os.environ.get("KVCORE_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "kvcore")
    return Path(root)


#: the file that makes a folder a kvcore cache entry: the checksum of each of its other files
MARKER = ".kvcore-entry"


def _fix(path: Path) -> str:
    return f"fix it (chmod 700, chown to yourself) or set KVCORE_CACHE_DIR to a folder of your own: {path}"


def check_trusted(path: Path, *, follow: bool = False) -> os.stat_result:
    """``path``'s ``lstat`` (``stat`` with ``follow``) when it is owned by the user or root, not writable
    by group or others and not a symbolic link; raises :class:`CacheTrustError` naming it otherwise."""
    st = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise CacheTrustError(f"refusing the cache path {path}: it is a symbolic link; {_fix(path)}")
    if st.st_uid not in (os.getuid(), 0):
        raise CacheTrustError(f"refusing the cache path {path}: it belongs to uid {st.st_uid}, not to you "
                              f"(uid {os.getuid()}); {_fix(path)}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheTrustError(f"refusing the cache path {path}: others can write it (mode "
                              f"{stat.S_IMODE(st.st_mode):03o}); {_fix(path)}")
    return st


def private_dir(path: Path, root: Path) -> Path:
    """Make ``path`` (under ``root``) and each missing folder between them with mode 0700, and check that
    ``root`` and every folder below it down to ``path`` can be trusted. Raises :class:`CacheTrustError`, or
    ``OSError`` when a folder cannot be made."""
    relative = path.relative_to(root)
    if not root.exists():
        root.mkdir(mode=0o700, parents=True)
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a folder")
    check_trusted(root, follow=True)
    current = root
    for part in relative.parts:
        current = current / part
        try:
            current.mkdir(mode=0o700)
        except FileExistsError:
            pass
        if not stat.S_ISDIR(check_trusted(current).st_mode):
            raise CacheTrustError(f"refusing the cache path {current}: it is not a folder; {_fix(current)}")
    return path


def _digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _identity(path: Path) -> list[int]:
    st = os.lstat(path)
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def _whole(path: Path, record) -> bool:
    """Whether the file ``path`` is what ``record`` (its marker line) says: its checksum, read again only when
    the file is no longer the one it was computed on."""
    if not stat.S_ISREG(check_trusted(path).st_mode):
        return False
    if isinstance(record, dict):
        if record.get("identity") == _identity(path):
            return True
        return "sha256" in record and _digest(path) == record["sha256"]  # without a checksum: changed is damaged
    return isinstance(record, str) and _digest(path) == record  # an entry written before identities were kept


def write_entry(parent: Path, name: str, fill: Callable[[Path], None], checksums: bool = True) -> Path:
    """Entry ``parent / name``: ``fill(folder)`` writes its files into a private temporary folder, which
    gets the marker and is renamed into place (atomically). When another process put the entry there
    first, that one stays. Raises ``OSError`` when the disk refuses.

    Without ``checksums`` the marker keeps only each file's identity: a file that is no longer the one written is
    then damaged (rebuilt) rather than hashed again, and writing costs no read of the files (a prepared model's
    entry is as large as the model)."""
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=parent))  # mode 0700
    try:
        (tmp / MARKER).write_text("{}")  # marked from the start: a crash leaves a folder kvcore may delete
        fill(tmp)
        files = [p for p in sorted(tmp.iterdir()) if p.name != MARKER]
        for p in files:
            p.chmod(0o600)  # whatever the umask: check_trusted refuses files others can write
        sums = {p.name: {"identity": _identity(p), **({"sha256": _digest(p)} if checksums else {})}
                for p in files}
        (tmp / MARKER).write_text(json.dumps(sums))
        try:
            os.rename(tmp, parent / name)
        except OSError:
            if not is_entry(parent / name):  # not another process's finished entry: something else is there
                raise FileExistsError(errno.EEXIST, "a folder kvcore did not write is in the way",
                                      str(parent / name)) from None
        else:
            tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return parent / name


def is_entry(path: Path) -> bool:
    """Whether ``path`` is a folder kvcore wrote (not a link, with a regular marker file)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode) and stat.S_ISREG(os.lstat(path / MARKER).st_mode)
    except OSError:
        return False


def remove_entry(path: Path) -> bool:
    """Delete ``path`` if it is a kvcore entry (:func:`is_entry`); whether it was."""
    if not is_entry(path):
        return False
    shutil.rmtree(path, ignore_errors=True)  # does not follow links inside
    return True


def verify_entry(path: Path) -> bool:
    """Whether entry ``path`` is whole: trusted, marked, and every file it lists has its checksum. A
    damaged entry is deleted (it is then rebuilt). Raises :class:`CacheTrustError` for an untrusted one."""
    if not os.path.lexists(path):
        return False
    check_trusted(path)
    try:
        sums = json.loads((path / MARKER).read_text())
        whole = isinstance(sums, dict) and bool(sums) and all(_whole(path / name, r) for name, r in sums.items())
    except (OSError, ValueError):
        whole = False
    if not whole:
        warnings.warn(f"kvcore: warning: the cache entry {path} is damaged; rebuilding it", RuntimeWarning,
                      stacklevel=2)
        remove_entry(path)
    return whole


def warn_no_cache(what: str, folder: Path, exc: OSError) -> None:
    """One warning line: the cache cannot be written, so this run goes without it."""
    reason = exc.strerror or str(exc)
    warnings.warn(f"kvcore: warning: cannot use the {what} cache in {folder} ({reason}); running without it",
                  RuntimeWarning, stacklevel=3)
