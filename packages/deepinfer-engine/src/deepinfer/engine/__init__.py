"""deepinfer.engine: the DeepSeek-V4 model family and the offline inference engine."""

from deepinfer.engine.version import __version__

__all__ = ["__version__"]
