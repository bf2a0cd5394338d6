"""deepinfer.spec."""

from deepinfer.spec.version import __version__

__all__ = ["__version__"]
