"""Speculative decoding: the built-in proposers and the engine's side of a proposer.

``ngram`` (prompt lookup) and ``draft`` (a smaller model on a KV cache of its own) register through the
``kvcore_register_proposers`` hook, as a third-party proposer does; ``backoff`` is the draft-length and back-off
policy they share; ``speculator`` is what the engine calls: the per-request lifecycle, the draft budget, and
the checks on what a proposer returns. The contract is :mod:`kvcore.interfaces.proposer`, the acceptance rules
are :mod:`kvcore.sampling.rejection`, the verification step is :mod:`kvcore.engine.verify`.
"""
