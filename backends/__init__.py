"""Built-in attention backends (installed as ``kvcore.backends``).

Each module is a plugin: it registers its backend through the ``kvcore_register_backends`` hook,
exactly as a third-party package would.
"""
