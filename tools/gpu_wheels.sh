#!/usr/bin/env bash
# Download, on a machine with PyPI access, the small wheels tools/gpu_setup.sh needs on the
# offline GPU machine (Python 3.12, x86-64): hatchling and its needs, editables, xgrammar and
# its pure-Python needs. Usage: bash tools/gpu_wheels.sh [WHEEL_DIR]   (default: .whl)
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
mkdir -p "$dest"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for pkg in hatchling packaging pathspec pluggy trove-classifiers tomlkit editables \
           xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection \
           typing-extensions; do
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d "$dest" "$pkg"
done
ls "$dest"
