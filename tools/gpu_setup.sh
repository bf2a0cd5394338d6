#!/usr/bin/env bash
# Install the workspace packages, editable, into an existing Python that already has torch and
# triton (the GPU machine), offline: wheels for the build backend (and for xgrammar and its
# pure-Python needs) come from a local folder. Usage, from the repository root:
#     bash tools/gpu_setup.sh [WHEEL_DIR]     (default: .whl)
# Prepare WHEEL_DIR on a machine with PyPI access with `bash tools/gpu_wheels.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels="${1:-.whl}"
python="$(command -v python3)"
members=(packages/deepinfer-kernels packages/deepinfer-parallel packages/deepinfer-sampling
         packages/deepinfer-spec packages/deepinfer-engine kernels-nvidia kernels-ascend)
# Runtime extras the GPU image lacks (xgrammar and its pure-Python needs), never torch/triton.
extras=$(cd "$wheels" && ls xgrammar-*.whl apache_tvm_ffi-*.whl pydantic-*.whl pydantic_core-*.whl \
         annotated_types-*.whl typing_inspection-*.whl typing_extensions-*.whl 2>/dev/null || true)
if [ -n "$extras" ]; then
    (cd "$wheels" && uv pip install --quiet --offline --no-deps --python "$python" $extras)
fi
args=()
for m in "${members[@]}"; do args+=(-e "$m"); done
uv pip install --quiet --offline --find-links "$wheels" --no-deps --python "$python" "${args[@]}"
"$python" -c "import deepinfer.kernels, deepinfer.engine; print('deepinfer installed into', '$python')"
