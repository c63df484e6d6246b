#!/usr/bin/env bash
# Grids longer than one call to the GPU machine (10 minutes a command): the queue runs in its own
# process session, so it survives the call that started it while the machine stays held; each call
# returns when the queue is done or after LIM seconds, and leaves the progress under $OUT in four
# files (the machine returns at most 8): status.txt, tables.txt (every finished grid's table),
# logs.tgz (the runs' logs, evals.csv files and test scores), gpu_tests.log.
#
# Usage:  scripts/device_queue.sh start LIM QUEUEFILE   (the first call of a fresh machine)
#         scripts/device_queue.sh wait LIM                (every later call, at once: the machine goes
#                                                          back when idle)
# QUEUEFILE: one grid a line, `CORPUS LANG TIME VARIANT...` as scripts/real_grid.sh takes them,
# run one after another (each grid runs its variants one per GPU); '#' lines and blank lines skipped.
# GPU_TESTS="tests/a.py tests/b" runs `pytest -m gpu` on those in the start call, before the queue.
# A wait call that finds no queue prints NO_QUEUE (a fresh machine: the earlier one went back).
set -u
mode=${1:-wait}; lim=${2:-540}; queue=${3:-}
Q=${QUEUE_DIR:-/tmp/device_queue}; OUT=${OUT:-/tmp/out}; t0=$(date +%s)
GRID=${GRID_SCRIPT:-scripts/real_grid.sh}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-src} STREAMNMT_HOME=${STREAMNMT_HOME:-/tmp/snhome}

collect() {
  mkdir -p "$OUT"
  cat "$Q"/grid_*/grid_table.txt > "$OUT/tables.txt" 2>/dev/null
  cp "$Q/gpu_tests.log" "$OUT/" 2>/dev/null
  tar czf "$OUT/.logs.tgz" -C "$Q" --exclude='*.pt' --exclude='*.safetensors' logs queue.log 2>/dev/null \
    && mv "$OUT/.logs.tgz" "$OUT/logs.tgz"
  {
    date -u
    cat "$Q/done_grids" 2>/dev/null
    for f in "$Q"/logs/*/grid_*.log; do  # each run's newest epoch line
      [ -e "$f" ] || continue
      [[ $f == *_test.txt ]] && continue
      printf "%s: %s\n" "${f#"$Q"/logs/}" "$(grep -E '^ +[0-9]+ ' "$f" | tail -1 | tr -s ' ')"
    done
  } > "$OUT/status.txt"
}

if [ "$mode" = start ]; then
  if [ -e "$Q/started" ]; then
    echo "already started"
  else
    [ -f "$queue" ] || { echo "device_queue: QUEUEFILE not found: '$queue'"; exit 2; }
    mkdir -p "$Q/logs"; touch "$Q/started"; cp "$queue" "$Q/queue.txt"
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null
    if [ -n "${GPU_TESTS:-}" ]; then
      s=$(date +%s)
      # shellcheck disable=SC2086
      timeout 400 python3 -m pytest -m gpu -q -p no:cacheprovider $GPU_TESTS > "$Q/gpu_tests.log" 2>&1
      echo "rc=$? seconds=$(( $(date +%s) - s ))" >> "$Q/gpu_tests.log"
      tail -2 "$Q/gpu_tests.log"
    fi
    setsid nohup bash -c '
      i=0
      while read -r line; do
        [[ -z ${line// } || $line == \#* ]] && continue
        i=$((i + 1))
        # shellcheck disable=SC2086
        OUT="$0/grid_$i" GRID_LOGS="$0/logs/$i" GRID_ROOT="/tmp/device_queue_runs/$i" bash "$1" $line
        echo "grid $i done: $line" >> "$0/done_grids"
      done < "$0/queue.txt"
      touch "$0/QUEUE_DONE"' "$Q" "$GRID" > "$Q/queue.log" 2>&1 < /dev/null &
    sleep 1
  fi
fi
[ -e "$Q/started" ] || { echo NO_QUEUE; exit 0; }
while [ ! -e "$Q/QUEUE_DONE" ] && [ $(( $(date +%s) - t0 )) -lt "$lim" ]; do
  sleep 15
  collect
done
collect
cat "$OUT/status.txt"
[ -e "$Q/QUEUE_DONE" ] && { echo QUEUE_DONE; cat "$OUT/tables.txt"; }
exit 0
