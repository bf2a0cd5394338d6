"""Enforce the import directions of DESIGN.md section 2 on every package's source.

Parses each module under ``packages/*/src`` and ``kernels-*/src`` (imports anywhere in the file,
including inside functions, and ``importlib.import_module("deepinfer....")`` calls with a literal
name) and fails, listing every offending line, when a package imports one of ours it may not.
Run: ``python tools/check_imports.py [ROOT]``; exit 1 on a violation.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

# package -> the packages of ours it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "kernels": set(),
    "kernels_nvidia": {"kernels"},
    "kernels_ascend": {"kernels"},
    "parallel": {"kernels"},
    "sampling": {"kernels"},
    "spec": {"sampling", "kernels"},
    "engine": {"kernels", "parallel", "sampling", "spec"},
}
SOURCE_GLOBS = ("packages/*/src/deepinfer/*", "kernels-*/src/deepinfer/*")


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            if node.module == "deepinfer":
                found += [(node.lineno, f"deepinfer.{a.name}") for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def violations(root: Path) -> list[str]:
    problems = []
    packages = [p for g in SOURCE_GLOBS for p in sorted(root.glob(g)) if p.is_dir()]
    for pkg_dir in packages:
        owner = pkg_dir.name
        if owner not in ALLOWED:
            problems.append(f"{pkg_dir}: package {owner!r} has no row in the import table")
            continue
        for path in sorted(pkg_dir.rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for lineno, module in _imported_modules(tree):
                parts = module.split(".")
                if parts[0] != "deepinfer" or len(parts) < 2:
                    continue
                target = parts[1]
                if target != owner and target not in ALLOWED[owner]:
                    rel = path.relative_to(root)
                    problems.append(
                        f"{rel}:{lineno}: deepinfer.{owner} may not import {module} "
                        f"(allowed: {', '.join(sorted(ALLOWED[owner])) or 'nothing of ours'})"
                    )
    if not packages:
        problems.append(f"no package sources found under {root}")
    return problems


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    problems = violations(root)
    for line in problems:
        print(line)
    if problems:
        print(f"import contracts broken: {len(problems)} violation(s)")
        return 1
    print("import contracts kept")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
