"""Runnable examples; ``tiny_model`` is a package whose scripts run as ``python -m``."""
