#!/usr/bin/env bash
# On the GPU machine: install the workspace offline (tools/gpu_setup.sh) and run every GPU test
# (`pytest -m gpu`) of the kernels, the NVIDIA backend, the engine, the integration suite and the
# benchmarks' and examples' own tests: the kernel packages over 8 workers when pytest-xdist is
# installed (Triton compiles dominate), the rest over one worker per 32 GiB of GPU memory (at most
# 4; GPU_CHECK_ENGINE_WORKERS overrides). Each group prints its 20 slowest tests (what a one-call
# run of the whole suite has to shorten).
# Usage, from the repository root:
#     bash tools/gpu_check.sh [WHEEL_DIR] [extra pytest arguments, e.g. -k moe]
set -euo pipefail
cd "$(dirname "$0")/.."
wheels="${1:-.whl}"
shift || true
bash tools/gpu_setup.sh "$wheels" >/dev/null
parallel=()
if python3 -c "import xdist" 2>/dev/null; then
    parallel=(-n 8)
fi
status=0
note() { [ "$1" -eq 5 ] || status=$1; }  # 5: a -k filter selected nothing in that group
python3 -m pytest -m gpu -q -p no:cacheprovider --durations=20 "${parallel[@]}" \
    packages/deepinfer-kernels/tests kernels-nvidia/tests packages/deepinfer-sampling/tests \
    packages/deepinfer-spec/tests "$@" || note $?
# The engine and integration tests size their KV cache from the GPU's free memory, which other
# workers on the same GPU take (8 workers: "no room for the KV cache"): few workers, a test file
# per worker (its built model stays there), each giving its cached blocks back after every GPU
# test (the root conftest), so a worker holds one test's memory at a time.
engine_parallel=()
if [ ${#parallel[@]} -gt 0 ]; then
    gib=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)")
    workers=${GPU_CHECK_ENGINE_WORKERS:-$((gib / 32 < 4 ? gib / 32 : 4))}
    if [ "$workers" -gt 1 ]; then
        engine_parallel=(-n "$workers" --dist loadgroup)
    fi
fi
python3 -m pytest -m gpu -q -p no:cacheprovider --durations=20 "${engine_parallel[@]}" \
    packages/deepinfer-engine/tests integration \
    benchmarks/tests examples/tiny_model/tests "$@" \
    || note $?
exit "$status"
