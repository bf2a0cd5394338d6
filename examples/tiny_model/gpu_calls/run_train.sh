#!/usr/bin/env bash
# Issue 6, backbone call (nvidia-h200-x2; the shipped run used DSTEPS=400 DM=2.2, then
# run_dspark.sh retrained the draft stages for 900 steps): the tiny-model recipe twice at once with the same seed,
# the same --batch and the same explicit --steps, run a on GPU 0 and run b on GPU 1.
# STEPS unset: measured here first (bench_train_step.py on GPU 0, ~20 s), so that the backbone
# loop fills LOOP_S seconds, capped at MAX_EPOCHS passes over train.bin; both runs get that
# one number. Files in $OUT (8): ckpt_{a,b}.tar.part-* (<= 15 MB each), logs_{a,b}.tgz.
set -u
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
D=examples/tiny_model/data; mkdir -p $D && cp .gpu_data/validation.bin .gpu_data/*.json $D/ && gzip -dc .gpu_data/train.bin.gz > $D/train.bin
t0=$(date +%s)
PY=${PY:-python}  # (PY, SKIP_SETUP, EXTRA: for a dry run of this script on a CPU machine)
[ -n "${SKIP_SETUP:-}" ] || bash tools/gpu_setup.sh .whl > setup.txt 2>&1 || { tail -20 setup.txt; exit 1; }
echo "setup $(( $(date +%s) - t0 )) s"; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
BATCH=${BATCH:-128}
mkdir -p bench-out/runs/a bench-out/runs/b
if [ -z "${STEPS:-}" ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 70 $PY -m examples.tiny_model.bench_train_step --batches $BATCH \
    --warmup 3 --steps 5 --qat-steps 0 --out bench-out/runs/a/calibration.json > calibration.log 2>&1
  STEPS=$(python3 -c "
import json, sys
try: s = json.load(open('bench-out/runs/a/calibration.json'))['rows'][0]['step_s']
except Exception: print(${FALLBACK_STEPS:-400}); sys.exit()
cap = int(${MAX_EPOCHS:-5} * 8_320_275 / ($BATCH * 512))
print(max(100, min(cap, int(${LOOP_S:-275} / (1.05 * s)))))")
  grep "s/step" calibration.log
fi
echo "STEPS=$STEPS BATCH=$BATCH at $(( $(date +%s) - t0 )) s"
ARGS="--steps $STEPS --batch $BATCH --max-train-minutes ${MAXM:-5.6} --dspark-steps ${DSTEPS:-900} --dspark-max-minutes ${DM:-3.5} ${EXTRA:-}"
CUDA_VISIBLE_DEVICES=0 $PY -m examples.tiny_model.recipe --seed 0 --out bench-out/runs/a $ARGS > runs_a.log 2>&1 &
pa=$!
CUDA_VISIBLE_DEVICES=1 $PY -m examples.tiny_model.recipe --seed 0 --out bench-out/runs/b $ARGS > runs_b.log 2>&1 &
pb=$!
pack() {  # $1 = a or b: its checkpoint in <= 15 MB parts, its logs and JSON (no checkpoint)
  [ -d bench-out/runs/$1/checkpoint ] && tar cf - -C bench-out/runs/$1 checkpoint | split -b 15000000 - $OUT/ckpt_$1.tar.part-
  tar czf $OUT/logs_$1.tgz runs_$1.log calibration.log $(find bench-out/runs/$1 -name "*.json" -o -name "*.txt" | grep -v /checkpoint/) 2>/dev/null
}
wait_for() {  # $1 = pid, $2 = name, $3 = limit (s from t0)
  while kill -0 $1 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt $3 ]; do sleep 2; done
  if kill -0 $1 2>/dev/null; then echo "run $2 still running at $3 s: killed"; kill $(pgrep -P $1) $1 2>/dev/null; sleep 1
  else wait $1; echo "run $2 rc=$? at $(( $(date +%s) - t0 )) s"; fi
}
wait_for $pa a ${LIMIT_A:-550}; pack a
wait_for $pb b ${LIMIT_B:-558}; pack b
ls -la $OUT
for r in a b; do echo "---- run $r"; grep -h "===\|phase wall\|trained\|Traceback\|Error" runs_$r.log | tail -14; done
