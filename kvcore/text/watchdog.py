"""A deadline for a block of Python code: :class:`Watchdog` raises an exception inside the thread running the block
once its time is up (the block is bytecode, so the exception lands at its next instruction). What bounds a model's
chat template (:mod:`kvcore.text.chat_template`), which is code from the model file."""

from __future__ import annotations

import ctypes
import gc
import threading
from typing import Any

__all__ = ["Watchdog"]


class Watchdog:
    """Raises ``error`` in the thread that entered the block once ``timeout_s`` have passed, unless the
    block has left by then. A pending, undelivered exception is withdrawn on exit.

    The exception lands at whatever bytecode the thread runs, so the block runs with the cyclic garbage collector
    paused: a collection started by the block's allocations would run other code's weakref callbacks and
    finalizers there, and the exception would cut one of those short instead of the block."""

    def __init__(self, error: BaseException, timeout_s: float) -> None:
        self._error, self._timeout_s = error, timeout_s
        self._lock = threading.Lock()
        self._active = False
        self._fired = False

    def __enter__(self) -> None:
        self._thread_id = threading.get_ident()
        _GC_PAUSE.enter()
        self._active = True
        self._timer = threading.Timer(self._timeout_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if self._active:
                self._fired = True
                _set_async_exc(self._thread_id, _timeout_class(self._error))

    def __exit__(self, exc_type, exc, tb) -> None:
        self._timer.cancel()
        with self._lock:
            self._active = False
            if self._fired:
                _set_async_exc(self._thread_id, None)  # withdraw it if not delivered yet
        _GC_PAUSE.exit()
        if self._fired and (exc_type is None or not issubclass(exc_type, type(self._error))):
            raise self._error from None


class _CollectorPause:
    """The cyclic garbage collector paused while any thread is inside a :class:`Watchdog` block (the collector's
    switch is the process's, and watched blocks of several threads overlap), then restored as it was."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._was_enabled = False

    def enter(self) -> None:
        with self._lock:
            if not self._inside:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._inside += 1

    def exit(self) -> None:
        with self._lock:
            self._inside -= 1
            if not self._inside and self._was_enabled:
                gc.enable()


_GC_PAUSE = _CollectorPause()


def _set_async_exc(thread_id: int, exc_type: type[BaseException] | None) -> None:
    """Schedule ``exc_type`` in thread ``thread_id`` (None: cancel a scheduled one; C's NULL)."""
    exc = ctypes.py_object(exc_type) if exc_type is not None else None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), exc)


def _timeout_class(error: BaseException) -> type[BaseException]:
    """A subclass of ``error``'s type whose instances carry its message (Python instantiates the exception at
    delivery, with no arguments)."""
    message = str(error)

    class TemplateTimeout(type(error)):
        def __init__(self, *args: Any) -> None:
            super().__init__(message)

    return TemplateTimeout
