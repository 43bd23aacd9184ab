"""The plugin module named by the ``kvcore`` entry point: one hook, one ``register`` call."""

from kvcore import hookimpl
from kvcore_example_backend.backend import ChunkedAttentionBackend


@hookimpl
def kvcore_register_backends(register):
    register(ChunkedAttentionBackend)
