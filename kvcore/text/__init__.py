"""Text: tokenizers, vocabularies, chat templates, incremental detokenising and stop strings."""
