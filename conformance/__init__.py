"""Conformance suite (installed as kvcore.conformance)."""
