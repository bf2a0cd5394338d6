#!/usr/bin/env bash
# Issue 6, second call (nvidia-h200-x2): the DSpark stages retrained for more steps against run
# b's backbone, recovered from its export (same values as the fake-quantised backbone.pt the
# recipe trains them against), twice with the same seed (GPU 0: a, GPU 1: b); run b's export is
# evaluated (quantised NLL, bigram, completions, teacher-forced DSpark acceptance + ECE).
set -u
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
D=examples/tiny_model/data; mkdir -p $D && cp .gpu_data/validation.bin .gpu_data/*.json $D/ && gzip -dc .gpu_data/train.bin.gz > $D/train.bin
t0=$(date +%s); T=examples/tiny_model
bash tools/gpu_setup.sh .whl > setup.txt 2>&1 || { tail -20 setup.txt; exit 1; }
echo "setup $(( $(date +%s) - t0 )) s"
mkdir -p r/a r/b
python -m examples.tiny_model.backbone_from_checkpoint --checkpoint examples/tiny_model/checkpoint --out r/backbone.pt || exit 1
UNQ=2.433845969848335  # run b's unquantised validation NLL (train.json, the same windows)
DS="--backbone r/backbone.pt --seed 0 --device cuda --steps ${DSTEPS:-1200} --max-minutes ${DM:-4.6}"
one() {  # $1 = a|b, on CUDA_VISIBLE_DEVICES
  python -m examples.tiny_model.train_dspark $DS --out r/$1/dspark.pt > r/$1/train_dspark.log 2>&1
  echo "dspark $1 rc=$? at $(( $(date +%s) - t0 )) s"
  python -m examples.tiny_model.export --backbone r/backbone.pt --dspark r/$1/dspark.pt --out r/$1/checkpoint > r/$1/export.log 2>&1
  echo "export $1 rc=$? at $(( $(date +%s) - t0 )) s"
  python -m examples.tiny_model.dspark_eval --checkpoint r/$1/checkpoint --device cuda --out r/$1/dspark_eval.json > r/$1/dspark_eval.log 2>&1
  echo "dspark_eval $1 rc=$? at $(( $(date +%s) - t0 )) s"
}
( export CUDA_VISIBLE_DEVICES=0; one a
  timeout 100 python -m pytest kernels-nvidia/tests/kernels_nvidia/test_sampling_cutoff_kernels.py kernels-nvidia/tests/kernels_nvidia/test_sampling_kernels.py -q -m gpu -p no:cacheprovider > r/a/sampling_tests.log 2>&1
  echo "sampling tests rc=$? at $(( $(date +%s) - t0 )) s" ) &
pa=$!
( export CUDA_VISIBLE_DEVICES=1
  python -m examples.tiny_model.evaluate --backbone r/backbone.pt --checkpoint examples/tiny_model/checkpoint --out r/b/results.json --device cuda --unquantised-nll $UNQ > r/b/evaluate.log 2>&1
  echo "evaluate rc=$? at $(( $(date +%s) - t0 )) s" ) &
pe=$!
( export CUDA_VISIBLE_DEVICES=1; one b ) &
pb=$!
while kill -0 $pb 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt ${LIMIT:-400} ]; do sleep 2; done
kill $pa $pe $pb 2>/dev/null
[ -d r/b/checkpoint ] && tar cf - -C r/b checkpoint | split -b 15000000 - $OUT/ckpt_b.tar.part-
for x in a b; do tar czf $OUT/logs_$x.tgz $(find r/$x -name "*.json" -o -name "*.log" | grep -v /checkpoint/) 2>/dev/null; done
ls -la $OUT
for x in a b; do echo "---- $x"; grep -h "dspark:\|accepted length\|ECE" r/$x/*.log | tail -4; done
tail -12 r/b/evaluate.log; tail -4 r/a/sampling_tests.log
