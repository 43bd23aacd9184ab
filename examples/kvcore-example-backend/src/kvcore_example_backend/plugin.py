"""The plugin module named by the ``kvcore`` entry point: one hook per pluggable kind, one ``register`` call each.

kvcore loads this module through ``[project.entry-points.kvcore]`` in ``pyproject.toml`` and calls every
``kvcore_register_*`` hook it defines with a ``register`` callback; the class's ``name`` is what users
select (``backend = "example_chunked"``, ``kv_cache = "example_fp16"``, ``sampler = "example_repetition_penalty"``).
"""

from kvcore import hookimpl
from kvcore_example_backend.backend import ChunkedAttentionBackend
from kvcore_example_backend.cache import Float16KVCache
from kvcore_example_backend.sampler import RepetitionPenaltySampler


@hookimpl
def kvcore_register_backends(register):
    register(ChunkedAttentionBackend)


@hookimpl
def kvcore_register_kv_caches(register):
    register(Float16KVCache)


@hookimpl
def kvcore_register_samplers(register):
    register(RepetitionPenaltySampler)
