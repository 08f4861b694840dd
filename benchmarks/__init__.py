"""Benchmarks: ``python -m benchmarks`` (see __main__.py and RESULTS.md)."""
