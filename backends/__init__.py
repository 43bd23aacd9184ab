"""Built-in attention backends and KV caches (installed as ``kvcore.backends``).

Each backend or cache module is a plugin: it registers through the ``kvcore_register_backends`` /
``kvcore_register_kv_caches`` hooks, exactly as a third-party package would. They build on the contracts and
kernels only: nothing here imports the runner, the scheduler or the model. ``ngram``, ``draft`` and ``backoff``
are deprecated aliases of the modules of :mod:`kvcore.speculative`, where the proposers live.
"""
