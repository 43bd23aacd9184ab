"""kvcore-bench: the ``kvcore bench`` command, a plugin shipped separately from the kvcore runtime.

The harness is :mod:`kvcore_bench.bench`; :mod:`kvcore_bench.plugin` adds the command to the ``kvcore``
CLI through the ``kvcore_register_commands`` hook (entry point ``bench`` in the ``kvcore`` group).
"""
