"""Prepare the tiny model's corpus: the running Python's standard-library source, split by file.

Every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` is taken, in sorted path order,
except third-party and build-machine files (``site-packages``, ``dist-packages``,
``lib-dynload``, ``config-*``, ``__pycache__``, ``_sysconfigdata_*.py``) and files that are not
valid UTF-8 (a few test fixtures on purpose). The standard library's own test suite (``test/``,
``*/tests/``, ``idle_test/``) is KEPT by default: it is ~60% of the source and the tiny model
overfits the smaller corpus quickly; ``--exclude-tests`` drops it.

A file goes to validation when the first 8 hex digits of sha256(its relative path), as an
integer, modulo 100 is below ``--validation-percent``; the split depends only on the path, so
it is the same on every machine and does not move when a file's content changes.

Writes into ``--output-dir`` (default ``examples/tiny_model/data``, git-ignored):
``train.jsonl`` and ``validation.jsonl`` (one ``{"path", "text"}`` object per file, in sorted
path order) and ``corpus.json`` (Python version, counts, bytes, skipped files, sha256 of the
two JSONL files). Same Python version -> byte-identical output.

    python -m examples.tiny_model.prepare_corpus
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXCLUDED_DIRS = {"site-packages", "dist-packages", "lib-dynload", "__pycache__"}
TEST_DIRS = {"test", "tests", "idle_test"}


def is_excluded(relative: Path, *, exclude_tests: bool) -> bool:
    """Third-party, compiled-in or build-machine files (and, optionally, the test suite)."""
    directories = relative.parts[:-1]
    if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in directories):
        return True
    if relative.name.startswith("_sysconfigdata_"):
        return True
    return exclude_tests and any(part in TEST_DIRS for part in directories)


def is_validation(relative_path: str, validation_percent: int) -> bool:
    """Deterministic split by the hash of the file's relative path."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % 100 < validation_percent


def collect_files(stdlib: Path, *, exclude_tests: bool) -> list[str]:
    """Relative POSIX paths of the corpus files, sorted."""
    paths = (path.relative_to(stdlib) for path in stdlib.rglob("*.py") if path.is_file())
    return sorted(p.as_posix() for p in paths if not is_excluded(p, exclude_tests=exclude_tests))


def write_split(path: Path, records: list[dict[str, str]]) -> str:
    """Write one JSONL split; return its sha256."""
    payload = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    data = payload.encode("utf-8")
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def prepare(output_dir: Path, *, validation_percent: int, exclude_tests: bool) -> dict:
    """Build both splits and the manifest; return the manifest."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    splits: dict[str, list[dict[str, str]]] = {"train": [], "validation": []}
    num_bytes = {"train": 0, "validation": 0}
    skipped = []
    for relative in collect_files(stdlib, exclude_tests=exclude_tests):
        raw = (stdlib / relative).read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(relative)
            continue
        split = "validation" if is_validation(relative, validation_percent) else "train"
        splits[split].append({"path": relative, "text": text})
        num_bytes[split] += len(raw)
    output_dir.mkdir(parents=True, exist_ok=True)
    manifest = {
        "python_version": platform.python_version(),
        "stdlib": str(stdlib),
        "validation_percent": validation_percent,
        "exclude_tests": exclude_tests,
        "skipped_not_utf8": skipped,
    }
    for split, records in splits.items():
        manifest[split] = {
            "num_files": len(records),
            "num_bytes": num_bytes[split],
            "sha256": write_split(output_dir / f"{split}.jsonl", records),
        }
    (output_dir / "corpus.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=HERE / "data")
    parser.add_argument("--validation-percent", type=int, default=5)
    parser.add_argument("--exclude-tests", action="store_true", help="drop the stdlib test suite")
    args = parser.parse_args(argv)
    if not 0 < args.validation_percent < 100:
        parser.error(f"--validation-percent is {args.validation_percent}; expected 1..99")
    manifest = prepare(
        args.output_dir,
        validation_percent=args.validation_percent,
        exclude_tests=args.exclude_tests,
    )
    for split in ("train", "validation"):
        info = manifest[split]
        print(f"{split:>10}: {info['num_files']:5d} files {info['num_bytes'] / 1e6:7.2f} MB")
    print(
        f"skipped (not UTF-8): {len(manifest['skipped_not_utf8'])}; Python {manifest['python_version']}"
    )
    print(f"wrote {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
