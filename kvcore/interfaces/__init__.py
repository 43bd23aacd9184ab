"""The contracts every pluggable kind implements: attention backends, KV caches, samplers, proposers.

Only errors and torch below; everything above programs against these classes, never a concrete one."""
