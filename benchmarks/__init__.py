"""Benchmarks and GPU validation scripts (``python -m benchmarks.gpu_validate``); not part of the installed package."""
