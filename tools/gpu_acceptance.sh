#!/usr/bin/env bash
# The H200 runs the open issues' acceptance lines need, in parts that each fit one device call
# (10 minutes): every command is time-boxed, its output goes to $OUT/<name>.txt (tracebacks
# included: --tb=short) and JSON results to $OUT/<name>.json; a one-line summary per command is
# printed. Usage, from the repository root on the GPU machine:
#     bash tools/gpu_acceptance.sh PART [WHEEL_DIR]
# PART: kernels | exact | engine | integration | async | parallel | prefill | rows | invariant
# (each case says what it runs).
set -uo pipefail
cd "$(dirname "$0")/.."
part="${1:?usage: gpu_acceptance.sh PART [WHEEL_DIR] (PART: see the header)}"
wheels="${2:-.whl}"
case "$part" in
kernels | exact | engine | integration | async | parallel | prefill | rows | invariant) ;;
*) echo "unknown part $part" >&2; exit 2 ;;
esac
out="$(realpath -m "${OUT:-bench-out}")"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 DEEPINFER_ACCELERATOR=nvidia
bash tools/gpu_setup.sh "$wheels" >/dev/null 2>&1 || { echo "install failed"; exit 1; }
echo "tree $(git rev-parse --short HEAD 2>/dev/null || cat .rev 2>/dev/null || echo unknown)"

# box NAME SECONDS CMD...: run CMD within SECONDS, output in $out/NAME.txt, one summary line
box() {
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    rc=$?
    echo "$name rc=$rc $(($(date +%s) - t0))s: $(grep -E 'passed|failed|error' "$out/$name.txt" \
        | tail -1 | cut -c1-160)"
    grep -E '^(FAILED|ERROR) ' "$out/$name.txt" | head -6
}
gpu_tests() { python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short "$@"; }
engine=packages/deepinfer-engine/tests/engine

case "$part" in
kernels)  # every kernel GPU test over 8 workers (issues 19, 23, 26, 30: ~240 s)
    box kernels 560 gpu_tests -n 8 packages/deepinfer-kernels/tests kernels-nvidia/tests \
        packages/deepinfer-sampling/tests packages/deepinfer-spec/tests
    ;;
exact)  # issues 19, 30: the batch-invariant matrix on the GPU, five checkpoints (~400 s)
    box exact 560 gpu_tests "$engine/runner/test_llm_exactness.py"
    ;;
engine)  # the engine's other GPU tests (~400 s on a fresh machine: Triton compiles)
    box engine-async 120 gpu_tests "$engine/runner/test_async_gpu.py"
    box engine 420 gpu_tests "$engine/runner/test_spec_gpu.py" "$engine/runner/test_decode_graphs.py" \
        "$engine/model" "$engine/checkpoint/test_dummy_gpu.py" "$engine/parallel"
    ;;
integration)  # the integration, benchmarks' and examples' GPU tests (~160 s), then misc
    box integration 240 gpu_tests integration benchmarks/tests examples/tiny_model/tests
    box cache-rows 120 python3 -m benchmarks.kernels.bench_cache_rows --out "$out/cache_rows.json"
    box vision 120 python3 -m benchmarks.model.bench_vision --layers 4 --out "$out/vision.json"
    ;;
async)  # issue 22: the embedded model with and without DSpark, async on / off (one run each)
    box spec 300 python3 -m benchmarks.engine.bench_spec --batches 1,8,64 --async on,off \
        --timeline --out "$out/spec.json"
    box async4 200 python3 -m benchmarks.engine.bench_engine --layers 4 --decode-batches 1,64 \
        --job 64 --async on,off --timeline-batches 64 --out "$out/async4.json"
    ;;
parallel)  # issue 20: one rank of EP projected on one H200 (the EP=2 V4-Flash row exists)
    box cache-reads 200 gpu_tests benchmarks/tests/test_cache_reads_gpu.py
    box ep8-v41 280 python3 -m benchmarks.parallel.ep_projection --model v41-flash --ep 8 \
        --out "$out/ep8_v41.json"
    box ep1-32 140 python3 -m benchmarks.parallel.ep_projection --model v4-flash --ep 1 \
        --layers 32 --out "$out/ep1_32.json"
    box ep2-32 140 python3 -m benchmarks.parallel.ep_projection --model v4-flash --ep 2 \
        --layers 32 --out "$out/ep2_32.json"
    ;;
prefill)  # issues 24 and 25: the prefill breakdown, YoCo at 32k
    box breakdown 300 python3 -m benchmarks.engine.prefill_breakdown --layers 4 \
        --out "$out/breakdown"
    box yoco32k 250 python3 -m benchmarks.engine.bench_yoco_prefill --layers 12 \
        --prompt-lens 32768 --gpu-memory-utilization 0.8 --out "$out/yoco32k.json"
    ;;
rows)  # issue 24: the sweep and the engine bench on one machine, the 32-layer prefill rows
    box sweep 240 benchmarks/run_sweep.sh --model v4-flash-dummy --layers 4 \
        --prefill-tokens 1024,8192 --concurrency 1,8 --repeats 3 --out "$out/sweep"
    box engine4 90 python3 -m benchmarks.engine.bench_engine --layers 4 --prefill-prompts 1,8 \
        --decode-batches 1 --modes eager --out "$out/engine4.json"
    box engine32 240 python3 -m benchmarks.engine.bench_engine --layers 32 \
        --prefill-shapes 8x1024,1x8192,1x32768 --decode-batches "" --out "$out/engine32.json"
    ;;
invariant)  # issue 30: the batch-invariant mode's cost, both modes in one call
    box bi-on 260 python3 -m benchmarks.engine.bench_engine --modes eager --batch-invariant \
        --out "$out/bi_on.json"
    box bi-off 260 python3 -m benchmarks.engine.bench_engine --modes eager --out "$out/bi_off.json"
    ;;
esac
