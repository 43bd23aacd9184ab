"""Plugin hook specifications. The docstrings are the spec.

A plugin is a module (or object) with functions named like these hooks, decorated with
``kvcore.hookimpl``, advertised under the ``kvcore`` entry-point group::

    [project.entry-points.kvcore]
    my_backend = "my_package.plugin"
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import pluggy

if TYPE_CHECKING:
    from kvcore.attention import AttentionBackend

__all__ = ["hookspec", "hookimpl", "RegisterBackend", "kvcore_register_backends"]

hookspec = pluggy.HookspecMarker("kvcore")
hookimpl = pluggy.HookimplMarker("kvcore")


class RegisterBackend(Protocol):
    def __call__(self, backend_cls: type[AttentionBackend], *, name: str | None = None) -> None: ...


@hookspec
def kvcore_register_backends(register: RegisterBackend) -> None:
    """Register attention backends.

    Call ``register(BackendClass)`` once per backend; ``name`` defaults to ``BackendClass.name``.
    The class must subclass :class:`kvcore.AttentionBackend` and implement every abstract method,
    or registration fails with the missing names. A name registered by two plugins is an error that
    names both. Import heavy or optional packages (flash-attn, xformers) inside the backend's methods,
    not at module import, so listing backends stays cheap and never fails.

    :param register: callback that records one backend class.
    """


@hookspec
def kvcore_configure(options: dict[str, Any]) -> None:
    """Receive this plugin's options from the config file.

    Called once after loading, with the ``[plugins.<plugin name>]`` table of the config file
    (an empty dict when there is none). Per-backend options go in ``[backends.<backend name>]``
    instead and reach the backend's constructor as keyword arguments.

    :param options: the plugin's own config table.
    """
