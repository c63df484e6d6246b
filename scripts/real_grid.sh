#!/usr/bin/env bash
# Recipes on a real corpus (scripts/make_real_corpus.py): each variant trained for the same wall-clock
# budget, one run per GPU at a time, then its best.pt scored on the test split; a table last (test
# BLEU, the best dev BLEU with its wall-clock second and step, the median target tokens/s of the epoch
# lines, the set-up seconds, the training share of the wall clock, the tokenizers' pieces and how the
# step was compiled (off, a cold or warm compile cache, or background): the columns
# docs/PERFORMANCE.md's real-text tables carry; $OUT/grid_table.md has the same rows in its tables' form).
#
# Usage: OUT=dir scripts/real_grid.sh CORPUS LANG TIME VARIANT...
#   CORPUS   a folder with train/dev/test JSON ({"en": ..., LANG: ...} records)
#   TIME     --time-limit of every run (e.g. 2m)
#   VARIANT  NAME or NAME:FLAG,FLAG with flags written --flag=value, e.g. d03:--dropout=0.3
#            (two variants of the same flags and other seeds: d03s2:--dropout=0.3,--seed=2);
#            a NAME starting with "eole" runs scripts/eole_compare.py instead (its flags after the colon),
#            its training loop given TIME (its set-up not counted: the peer gets the benefit of the doubt)
# Each run gets its own copy of the corpus's files (the splits, corpus_info.json), never its folders (an
# earlier run's tokenizer/ and cache/): every run trains its tokenizers and tokenizes its splits inside
# its own time, as a user's first run does.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-src} STREAMNMT_HOME=${STREAMNMT_HOME:-/tmp/snhome}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# Logs go to LOGS and come back as one archive, rewritten after every wave (a call that runs past its
# limit still returns the waves that finished; the device returns a few files per call, not one per run).
LOGS=${GRID_LOGS:-/tmp/grid_logs}; mkdir -p "$LOGS"
corpus=$1 lang=$2 budget=$3; shift 3
root=${GRID_ROOT:-/tmp/grid}/$(basename "$corpus"); mkdir -p "$root"
# GRID_GPUS="1 3" runs on those GPUs only (another job may hold the rest); default: every GPU of the machine.
read -ra G <<< "${GRID_GPUS:-$(seq -s' ' 0 $(( $(nvidia-smi -L 2>/dev/null | wc -l) - 1 )) 2>/dev/null)}"
[ ${#G[@]} -ge 1 ] || G=(0)
gpus=${#G[@]}
V=("$@")

seconds() {  # 2m, 90s, 1.5h, 1h30m, 120 -> whole seconds
  python3 -c "import re,sys; s=sys.argv[1]; print(round(sum(float(n)*{'h':3600,'m':60,'s':1,'':1}[u] for n,u in re.findall(r'(\d+(?:\.\d+)?)([hms]?)', s))))" "$1"
}

train_one() {  # GPU NAME FLAGS...
  local gpu=$1 name=$2; shift 2
  rm -rf "$root/$name" "$root/data_$name"; mkdir -p "$root/data_$name"
  find "$corpus" -maxdepth 1 ! -type d -exec cp {} "$root/data_$name/" \;
  local guard=$(( $(seconds "$budget") + 300 ))  # a run past its budget and set-up is stopped (SIGTERM: saved)
  if [[ $name == eole* ]]; then
    CUDA_VISIBLE_DEVICES=$gpu timeout $guard python3 scripts/eole_compare.py --data "$root/data_$name" --src-lang en \
      --tgt-lang "$lang" --time-limit "$(seconds "$budget")" --work "$root/$name" "$@" > "$LOGS/grid_$name.log" 2>&1
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"BLEU = {r['bleu']:.2f}\"); print(r)" \
      "$root/$name/result.json" > "$LOGS/grid_${name}_test.txt" 2>&1
    return
  fi
  CUDA_VISIBLE_DEVICES=$gpu timeout $guard python3 -m streamnmt train --data "$root/data_$name" --src-lang en \
    --tgt-lang "$lang" --time-limit "$budget" --project "$root" --name "$name" "$@" > "$LOGS/grid_$name.log" 2>&1
  CUDA_VISIBLE_DEVICES=$gpu timeout 300 python3 -m streamnmt eval --weights "$root/$name/weights/best.pt" \
    --data "$root/data_$name" --split test > "$LOGS/grid_${name}_test.txt" 2>&1
}

for ((i = 0; i < ${#V[@]}; i += gpus)); do  # one wave: a run on every GPU
  for ((g = 0; g < gpus && i + g < ${#V[@]}; g++)); do
    v=${V[$((i + g))]}; name=${v%%:*}; flags=()
    [ "${v#*:}" != "$v" ] && IFS=, read -ra flags <<< "${v#*:}"
    train_one "${G[$g]}" "$name" "${flags[@]}" &
  done
  wait
  tar czf "$OUT/.grid_logs.tgz.tmp" -C "$LOGS" . && mv "$OUT/.grid_logs.tgz.tmp" "$OUT/grid_logs.tgz"
done

{
printf "%-14s %8s %10s %6s %8s %8s %7s %6s %12s %9s\n" run test_BLEU best_dev at_s at_step tok/s setup_s train pieces compile
for v in "${V[@]}"; do
  name=${v%%:*}
  bleu=$(grep -oE "^BLEU = [0-9.]+" "$LOGS/grid_${name}_test.txt" 2>/dev/null | awk '{print $3}')
  # best dev BLEU of a whole pass (at wall s, step), tokens/s, set-up, training share, pieces, compile: grid_row.py
  row=$(python3 "$(dirname "$0")/grid_row.py" "$root/$name/evals.csv" "$LOGS/grid_$name.log" 2>/dev/null)
  read -r dev at_s at_step tok setup train pieces compiled <<< "${row:-- - - - - - - -}"
  printf "%-14s %8s %10s %6s %8s %8s %7s %6s %12s %9s\n" "$name" "${bleu:-failed}" "$dev" "$at_s" "$at_step" "$tok" \
    "$setup" "$train" "$pieces" "$compiled"
  # the same row as docs/PERFORMANCE.md's real-text tables write it (whether a set-up was a machine's first
  # run is for the reader of the lease to add)
  flags=""; [ "${v#*:}" != "$v" ] && flags=" \`${v#*:}\`" && flags=${flags//,/ } && flags=${flags//=/ }
  printf "| %s | %s%s | %s | %s (%s) | %s | %s | %s | %s s | %s |\n" "$(basename "$corpus")" "$name" "$flags" \
    "${bleu:-failed}" "$dev" "$at_s" "$at_step" "${pieces/\// / }" "$tok" "$setup" "${train/\%/ %}" >> "$OUT/grid_table.md"
  cp "$root/$name/evals.csv" "$LOGS/grid_${name}_evals.csv" 2>/dev/null
done
} | tee -a "$OUT/grid_table.txt"
tar czf "$OUT/.grid_logs.tgz.tmp" -C "$LOGS" . && mv "$OUT/.grid_logs.tgz.tmp" "$OUT/grid_logs.tgz"
