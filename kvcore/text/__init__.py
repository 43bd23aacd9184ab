"""Text (layer 1): tokenizers, vocabularies, chat templates, incremental detokenising and stop strings."""
