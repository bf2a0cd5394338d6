#!/usr/bin/env bash
# Prefill/decode sweeps, transformers baseline, roofline; see benchmarks/sweep/run_sweep.py.
set -euo pipefail
exec python "$(dirname "$0")/sweep/run_sweep.py" "$@"
