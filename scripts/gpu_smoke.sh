#!/usr/bin/env bash
# GPU machine: gpu-marked tests, then short training runs per strategy (timings are indicative only;
# the benchmark gives the reported figures).
export PYTHONUNBUFFERED=1 PYTHONPATH=src STREAMNMT_HOME=/tmp/snhome
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
python3 -m pytest -m gpu ${TESTS:-tests} -q -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
for s in ${STRATS:-baseline full graph}; do
  python3 -m streamnmt train --sync-strategy "$s" --max-steps ${STEPS:-300} --epochs 1 --bleu-samples 0 \
    --batch-size 32 --max-len 32 --project /tmp/runs --name "$s" ${EXTRA:-} > "$OUT/train_$s.log" 2>&1
  echo "== $s: $(grep -E 'graph mode|^ +1/' "$OUT/train_$s.log" | tr '\n' ' ')"
done
