"""kvcore's layers, lowest first: a module imports only its own package and packages of a lower rank.

Data only, read by tests/e2e/test_layers.py (which enforces the order) and scripts/gen_tables.py (which writes
docs/design.md's layer table from it): change the order or a description here, then run the script.
"""

from __future__ import annotations

#: (the packages and top-level modules of one rank, what lives there)
LAYERS: list[tuple[tuple[str, ...], str]] = [
    (("kvcore.version", "kvcore.errors"), "the version; the typed errors with their exit codes"),
    (("kvcore.paths", "kvcore.hookspecs"), "where kvcore keeps its files on disk; the plugin hook specifications"),
    (("kvcore.interfaces",), "the contracts: attention metadata and variants, `AttentionBackend`, `KVCache`, "
                             "`Sampler`, `SamplingParams`, `Proposer`, capabilities, how a setting is declared"),
    (("kvcore.kernels",), "CPU features, the C++ kernel build (`csrc/`), dense and quantized matmuls"),
    (("kvcore.text",), "tokenizers, vocabularies, chat templates, incremental detokenising and stop strings"),
    (("kvcore.backends",), "the built-in attention backends and KV caches: plugins like a third party's, built on "
                           "the contracts and kernels alone (the repository's `backends/` folder)"),
    (("kvcore.sampling",), "the default sampler and its logits processors, the acceptance rules of speculative "
                           "decoding (`rejection`)"),
    (("kvcore.scheduling",), "requests, the block manager, the scheduler, the KV manager"),
    (("kvcore.model",), "the decoder, its config, RoPE, weights, the LM head, architectures and families"),
    (("kvcore.plugins",), "the plugin registry, the pluggable kinds and the support tables"),
    (("kvcore.execution",), "the model runner, backend-output checks, compiled decode steps, tensor-parallel "
                            "execution (`distributed/`)"),
    (("kvcore.loaders",), "GGUF and Hugging Face loading, validation, the prepared-model cache"),
    (("kvcore.speculative",), "the built-in proposers (`ngram`, `draft`), their back-off policy, the engine's "
                              "side of a proposer"),
    (("kvcore.engine",), "`Engine` and its step, the engine's and the run's settings, the config file"),
    (("kvcore.serving",), "the OpenAI-compatible HTTP front"),
    (("kvcore.conformance",), "the release gate for backends, caches and samplers (the repository's "
                              "`conformance/` folder)"),
    (("kvcore.cli",), "the `kvcore` command"),
]
