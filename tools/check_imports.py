"""Enforce the import directions of DESIGN.md section 2 on every package's source.

Parses each module under ``packages/*/src`` and ``kernels-*/src`` (imports anywhere in the file,
including inside functions, and ``importlib.import_module("deepinfer....")`` calls with a literal
name) and fails, listing every offending line, when a package imports one of ours it may not.
It also fails on an import cycle between modules of ours: every import statement counts (a
function-local import is a cycle put off, not removed), ``from pkg import name`` counts as an
import of ``pkg.name`` when that is a module and of ``pkg`` otherwise, and each cycle is printed
as a chain ``a -> b -> a``.
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


def _module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of every package source tree."""
    modules = {}
    for src in [p for g in ("packages/*/src", "kernels-*/src") for p in sorted(root.glob(g))]:
        for path in sorted(src.rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _module_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that ``name`` imports anywhere in its file."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    found.add(f"{base}.{alias.name}")
                elif base in modules:
                    found.add(base)
    found.discard(name)
    return found


def _cycle_through(start: str, members: set[str], graph: dict[str, set[str]]) -> list[str]:
    """One import chain from ``start`` back to itself inside a strongly connected component."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for succ in sorted(graph[node] & members):
                if succ == start:
                    chain = [node]
                    while chain[-1] != start:
                        chain.append(parents[chain[-1]])
                    return [start, *reversed(chain[:-1]), start]
                if succ not in parents:
                    parents[succ] = node
                    nxt.append(succ)
        frontier = nxt
    return [start, start]


def cycles(root: Path) -> list[list[str]]:
    """Every import cycle between our modules, one chain per strongly connected component."""
    modules = _module_files(root)
    graph = {name: _module_imports(name, path, modules) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_through(min(c), c, graph) for c in components]


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    problems = violations(root)
    problems += [f"import cycle: {' -> '.join(chain)}" for chain in cycles(root)]
    for line in problems:
        print(line)
    if problems:
        print(f"import contracts broken: {len(problems)} violation(s)")
        return 1
    print("import contracts kept")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
