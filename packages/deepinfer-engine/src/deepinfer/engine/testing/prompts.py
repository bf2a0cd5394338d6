"""Prompt sets shared by the end-to-end tests."""

from __future__ import annotations

_NAMES = ["parse", "load_config", "read_lines", "merge", "validate", "encode", "flatten",
          "find_all", "split_path", "to_json"]  # fmt: skip
_TEMPLATES = [
    "def {name}(self, ",
    "def {name}(path):\n    ",
    '    def {name}(self):\n        """',
    "import os\n\n\ndef {name}(",
    "class {title}Error(Exception):\n    ",
]


def python_prompts() -> list[str]:
    """50 distinct Python-shaped openings (five templates x ten names), the kind of text the
    shipped tiny model was trained on."""
    return [t.format(name=n, title=n.title().replace("_", "")) for t in _TEMPLATES for n in _NAMES]
