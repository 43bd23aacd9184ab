"""The one place kvcore's version is written (pyproject.toml reads it without importing kvcore)."""

__version__ = "0.1.0"
