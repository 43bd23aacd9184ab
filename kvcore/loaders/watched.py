"""Model files a running model keeps reading, held open so that a change made to them in place is seen.

Two kinds of weights stay in their file after loading: a prepared-model cache entry's tensors are pages of
``model.pt`` mapped with ``torch.load(mmap=True)`` (:mod:`kvcore.loaders.model_cache`), and a quantized token table
is read row by row from the GGUF file (:mod:`kvcore.loaders.file_rows`); so do a draft model's that speculative
decoding loads (:attr:`kvcore.speculative.speculator.Speculator.models`). Replacing such a file (``mv``, an
editor's save, kvcore's own cache rebuild) is harmless: the open descriptor and the mapping keep the old file.
Changing it in place is not: written to, the model would run on other weights; truncated, a read of a mapped page
past the new end is a SIGBUS that kills the process (Python cannot turn a fault inside C code into an exception).

:class:`WatchedFile` compares the open file with what was loaded (one ``fstat``): the engine asks before every
forward and fails the step's requests with :class:`~kvcore.errors.ModelFileChangedError`, and the server's
``/health`` answers 503 with the same line. What stays is a window: a truncation during a forward, after the
check, still ends in SIGBUS (docs/serving.md says how to recognise it).
"""

from __future__ import annotations

import os
import weakref

from kvcore.errors import ModelFileChangedError, ModelLoadError

__all__ = ["WatchedFile", "model_file_problem"]


class WatchedFile:
    """``path``, opened read-only now; :meth:`problem` says whether it was truncated or written to since."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise ModelLoadError(f"cannot read '{self.path}': {exc.strerror or exc}") from None
        st = os.fstat(self.fd)
        self.size, self._mtime = st.st_size, st.st_mtime_ns
        weakref.finalize(self, os.close, self.fd)

    def problem(self) -> str | None:
        """One line saying how the file changed since it was opened, or None. One ``fstat``; any thread."""
        st = os.fstat(self.fd)
        if st.st_size < self.size:
            return (f"model file '{self.path}' was truncated while in use ({self.size} -> {st.st_size} bytes): "
                    "restart kvcore once the file is whole again")
        if st.st_size != self.size or st.st_mtime_ns != self._mtime:
            return f"model file '{self.path}' was written to while in use: restart kvcore to load it again"
        return None

    def check(self) -> None:
        """Raise :class:`~kvcore.errors.ModelFileChangedError` when :meth:`problem` finds one."""
        problem = self.problem()
        if problem is not None:
            raise ModelFileChangedError(problem)


def model_file_problem(*models) -> str | None:
    """How a file one of ``models`` reads weights from as it runs has changed, or None: the files its loader
    mapped (``model.mapped_files``) and the one its token table is read from (a GGUF table kept as blocks)."""
    files = []
    for model in models:
        table = getattr(model, "embedding", None)
        table_file = getattr(getattr(table, "blocks", None), "source_file", None)
        files += [*getattr(model, "mapped_files", ()), *([table_file] if table_file is not None else [])]
    return next((p for p in (f.problem() for f in files) if p is not None), None)
