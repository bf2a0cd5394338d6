"""Kernel benchmarks and sweeps, run from the repository root as
``python -m benchmarks.kernels.<name>``."""
