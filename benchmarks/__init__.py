"""Benchmarks of the optimizer step (installed as ``muoneq.benchmarks``; ``muoneq bench``)."""
