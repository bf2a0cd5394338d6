"""Conformance cases, one module per op family; each module calls ``register``."""
