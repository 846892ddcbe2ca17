"""Benchmarks of the serving path; run ``python -m bench.load``."""
