#!/usr/bin/env bash
# Prefill/decode sweeps, transformers baseline, roofline; see benchmarks/sweep/run_sweep.py.
# The benchmarks are modules of the `benchmarks` package, found from the repository root.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec python -m benchmarks.sweep.run_sweep "$@"
