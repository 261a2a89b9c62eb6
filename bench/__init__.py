"""Benchmarks: run as `python -m bench.NAME`; each prints one JSON object as its last line."""
