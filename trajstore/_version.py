"""The library version (read by pyproject.toml and written into every dump's manifest)."""

__version__ = "0.1.0"
