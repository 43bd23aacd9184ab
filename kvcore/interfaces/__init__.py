"""The contracts every pluggable kind implements (layer 1): attention backends, KV caches, samplers,
proposers.

Only errors and torch below; everything above programs against these classes, never a concrete one."""
