#!/usr/bin/env bash
# GPU machine: the training recipe against the earlier defaults on the built-in corpus, base model,
# the same training-time budget each (--time-limit; set-up and evaluation are not counted).
# Usage: scripts/recipe_compare.sh baseline|recipe   (each part fits in one 10-minute command)
#   baseline: label smoothing 0, untied embeddings; test BLEU of best.pt
#   recipe:   label smoothing 0.1, --tie-embeddings decoder, last 5 step checkpoints averaged;
#             test BLEU of best.pt and of the average
export PYTHONUNBUFFERED=1 PYTHONPATH=src STREAMNMT_HOME=/tmp/snhome
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-6m}; EPOCHS=${EPOCHS:-100}
common=(--model base --epochs "$EPOCHS" --time-limit "$BUDGET" --compile off --project /tmp/runs --exist-ok)
case "$1" in
  baseline)
    python3 -m streamnmt train "${common[@]}" --name baseline --label-smoothing 0 --tie-embeddings none \
      > "$OUT/recipe_baseline.log" 2>&1
    grep -E "^ +[0-9]+/|time limit|done" "$OUT/recipe_baseline.log"
    python3 -m streamnmt eval --weights /tmp/runs/baseline/weights/best.pt --split test 2>&1 | tail -2 ;;
  recipe)
    python3 -m streamnmt train "${common[@]}" --name recipe --label-smoothing 0.1 --tie-embeddings decoder \
      --save-every ${SAVE_EVERY:-2000} --keep-last 5 > "$OUT/recipe_recipe.log" 2>&1
    grep -E "^ +[0-9]+/|time limit|done" "$OUT/recipe_recipe.log"
    python3 -m streamnmt average --inputs /tmp/runs/recipe/weights/step_*.pt --out /tmp/runs/recipe/avg.pt
    echo "best.pt:"; python3 -m streamnmt eval --weights /tmp/runs/recipe/weights/best.pt --split test 2>&1 | tail -2
    echo "average of the last 5:"
    python3 -m streamnmt eval --weights /tmp/runs/recipe/avg.pt --split test 2>&1 | tail -2 ;;
esac
cp /tmp/runs/"$1"/results.png "$OUT/recipe_$1.png" 2>/dev/null; cp /tmp/runs/"$1"/evals.csv "$OUT/recipe_$1_evals.csv" 2>/dev/null
