"""deepinfer.parallel."""

from deepinfer.parallel.version import __version__

__all__ = ["__version__"]
