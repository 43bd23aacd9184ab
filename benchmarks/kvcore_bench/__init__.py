"""kvcore-bench: the ``kvcore bench`` command, a plugin shipped separately from the kvcore runtime.

:mod:`kvcore_bench.plugin` adds the command to the ``kvcore`` CLI through the ``kvcore_register_commands``
hook (entry point ``bench`` in the ``kvcore`` group), declaring it from :mod:`kvcore_bench.cli`;
:mod:`kvcore_bench.bench` runs it. The modules import downwards only (tests/e2e/test_layers.py checks it):

* no kvcore_bench imports: ``cli`` (the flags), ``common`` (prompt text, machine, kernels, ``--engine-option``),
  ``runs`` (one timed run on kvcore or transformers), ``native_llamacpp``, ``llamacpp_runner``, ``real_size``;
* the backend comparison: ``settings`` → ``harness`` → ``cases``, and ``report``;
* the other modes: ``vs_llamacpp``, ``vs_native``, ``scale`` (with ``scale_report``); ``startup`` (real sizes);
* ``bench``, the command, on top; ``plugin`` imports it only when ``kvcore bench`` runs.
"""
