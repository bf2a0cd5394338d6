"""deepinfer.sampling."""

from deepinfer.sampling.version import __version__

__all__ = ["__version__"]
