"""Source-layout rules of the lint session: names that say what a file holds, files small enough
to read at once, and no lab notes in comments.

Scans every ``*.py`` and ``*.sh`` file of the tree and fails, listing each finding, on:

- a file whose name holds ``_extra`` (name the file for what it holds);
- a Python file over ``MAX_LINES`` lines (split it by concept);

and, in ``#`` comments and the docstrings of Python modules, classes and functions (history and
numbers live in ``benchmarks/RESULTS.md``, which cites the raw files and commits; a comment says
why the code is as it is), on:

- a commit hash: a word of 7 to 40 hexadecimal digits holding both a digit and a letter;
- a results file: a dated ``YYYY-MM-DD-...`` file name, or a path into the raw results folder.

Run: ``python tools/check_source.py [ROOT] [FILE ...]``; exit 1 on a finding.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

MAX_LINES = 400
SKIP_PARTS = {".git", ".venv", ".nox", ".whl", ".carry", ".device", "node_modules", "data"}
HASH = re.compile(
    r"(?<![\w.#/-])(?!0[bx])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])"
)
RESULTS_FILE = re.compile(
    r"\b20\d\d-\d\d-\d\d-[\w.-]+|benchmarks/results\b|\bresults/[\w.-]+\.json"
)


def _findings(text: str) -> list[str]:
    return [m.group(0) for pattern in (HASH, RESULTS_FILE) for m in pattern.finditer(text)]


def _python_notes(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python source."""
    notes = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            notes.append((tok.start[0], tok.string))
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                doc = body[0].value.value
                if isinstance(doc, str):
                    for offset, line in enumerate(doc.splitlines()):
                        notes.append((body[0].lineno + offset, line))
    return notes


def _shell_notes(source: str) -> list[tuple[int, str]]:
    notes = []
    for number, line in enumerate(source.splitlines(), 1):
        stripped = line.lstrip()
        if stripped.startswith("#") and not stripped.startswith("#!"):
            notes.append((number, stripped))
    return notes


def check_file(path: Path) -> list[str]:
    source = path.read_text()
    problems = []
    if "_extra" in path.name:
        problems.append(f"{path}: '_extra' in the file name: name it for what it holds")
    lines = source.count("\n")
    if path.suffix == ".py" and lines > MAX_LINES:
        problems.append(f"{path}: {lines} lines, over {MAX_LINES}: split it by concept")
    notes = _python_notes(source) if path.suffix == ".py" else _shell_notes(source)
    for line, text in notes:
        for found in _findings(text):
            problems.append(f"{path}:{line}: {found!r} in a comment: history belongs in RESULTS.md")
    return problems


def source_files(root: Path) -> list[Path]:
    files = []
    for suffix in ("*.py", "*.sh"):
        for path in root.rglob(suffix):
            if not SKIP_PARTS.intersection(path.relative_to(root).parts):
                files.append(path)
    return sorted(files)


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    files = [Path(a) for a in argv[2:]] or source_files(root)
    problems = [p for f in files for p in check_file(f)]
    for line in problems:
        print(line)
    if problems:
        print(f"source layout rules broken: {len(problems)} finding(s)")
        return 1
    print(f"source layout rules kept in {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
