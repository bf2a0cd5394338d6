"""Model-level benchmarks: one forward of a dummy-weight model."""
