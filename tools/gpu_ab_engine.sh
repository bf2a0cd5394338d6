#!/usr/bin/env bash
# Same-machine A/B of the end-to-end engine benchmark: an earlier tree against this one, each
# installed editable into its own venv over the machine's torch, runs alternating, JSON under
# $OUT. Prepare the earlier tree here (it travels in an ignored folder; its examples link to this
# tree's, so the checkpoints travel once):
#     mkdir -p .carry && git archive REV --prefix=before/ packages kernels-nvidia kernels-ascend \
#         benchmarks tools pyproject.toml | tar -x -C .carry && ln -s ../../examples .carry/before/examples
# then on the GPU machine (device tool: carry [".whl", ".carry"]):
#     LAYERS="4 32" REPS=1 bash tools/gpu_ab_engine.sh .carry/before
# BEFORE_BENCH overrides how the earlier tree runs its benchmark (default: the module form, or the
# script path for trees from before the benchmarks became a package).
set -uo pipefail
export PYTHONUNBUFFERED=1
before="${1:?usage: gpu_ab_engine.sh BEFORE_TREE}"
root=$PWD
out="$(realpath -m "${OUT:-bench-out}")"
mkdir -p "$out"
venvs="$(mktemp -d)"  # one venv per tree, over the machine's torch
# The machine's torch may itself live in a venv, whose packages a new venv's
# --system-site-packages does not see: a .pth file adds them.
machine_site="$(python3 -c 'import torch, pathlib; print(pathlib.Path(torch.__file__).parents[1])')"
for side in before after; do
    uv venv -q --system-site-packages -p "$(command -v python3)" "$venvs/$side"
    echo "$machine_site" > "$("$venvs/$side/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/machine.pth"
done
PATH="$venvs/before/bin:$PATH" bash "$before/tools/gpu_setup.sh" "$root/.whl" | tail -1
PATH="$venvs/after/bin:$PATH" bash tools/gpu_setup.sh "$root/.whl" | tail -1
if [ -z "${BEFORE_BENCH:-}" ]; then
    if [ -f "$before/benchmarks/__init__.py" ]; then
        BEFORE_BENCH="-m benchmarks.engine.bench_engine"
    else
        BEFORE_BENCH="benchmarks/engine/bench_engine.py"
    fi
fi
args=(--prefill-prompts 1,8 --decode-batches 1,64 --decode-tokens 17 --modes graphs
      --gpu-memory-utilization 0.9)
for layers in ${LAYERS:-4 32}; do
    for rep in $(seq 1 "${REPS:-1}"); do
        echo "=== before, $layers layers, run $rep"
        (cd "$before" && "$venvs/before/bin/python" $BEFORE_BENCH --layers "$layers" "${args[@]}" \
            --out "$out/engine-before-$layers-$rep.json" 2>&1 | grep -v Warning | tail -12)
        echo "=== after, $layers layers, run $rep"
        "$venvs/after/bin/python" -m benchmarks.engine.bench_engine --layers "$layers" "${args[@]}" \
            --out "$out/engine-after-$layers-$rep.json" 2>&1 | grep -v Warning | tail -12
    done
done
