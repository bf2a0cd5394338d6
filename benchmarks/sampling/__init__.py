"""Sampler and structured-output benchmarks."""
