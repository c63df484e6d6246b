#!/usr/bin/env bash
# The benchmark table on the GPU machine (see docs/PERFORMANCE.md). Usage: scripts/gpu_measure.sh PART
export PYTHONUNBUFFERED=1 PYTHONPATH=src STREAMNMT_HOME=/tmp/snhome
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
# The GPU machine runs Python with PYTHONDONTWRITEBYTECODE=1 over a torch installed without bytecode, so
# each process compiled torch's sources as it imported them (torch._dynamo and Inductor's compiler: 7-8 s
# against 2-3 s). pip writes the bytecode when a user installs torch: compile it once, as pip would, so
# start-up figures are a user's (PYC=0 keeps the machine as it is). docs/PERFORMANCE.md, "The warm compile cache".
if [ "${PYC:-1}" = 1 ]; then
  unset PYTHONDONTWRITEBYTECODE
  site=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
  for pkg in torch sympy mpmath networkx triton numpy sentencepiece sacrebleu jinja2 yaml; do
    [ -d "$site/$pkg" ] && python3 -m compileall -q -j 0 "$site/$pkg" > /dev/null 2>&1
  done
fi
# The packed base model (graph, bf16, 32k vocabulary, 3 repeats, one process per row) at each budget in BUDGETS
# with each attention in ATTNS (sdpa, auto, triton or triton:QxK-wW-sS); the table last (attn-model says the knobs).
attn_model() {
  local DATA="" t a tiles row name
  if [ -n "${LONGTAIL:-}" ]; then
    python3 scripts/make_longtail.py --out /tmp/am_lt --pairs $LONGTAIL > "$OUT/am_longtail.txt" || { echo "make_longtail failed"; return 1; }
    DATA=/tmp/am_lt
  fi
  for t in ${BUDGETS:-4096 16384}; do for a in ${ATTNS:-sdpa triton}; do
    tiles=""; [ "${a#*:}" != "$a" ] && tiles=${a#*:}
    name=am_${t}_${a/:/_}
    STREAMNMT_ATTN_TILES=$tiles timeout 240 python3 -m streamnmt bench --model base --amp bf16 --vocab 32000 \
      --max-len 128 --max-tokens $t --no-references --repeats 3 ${UNCOMPILED:---compile} --strategies graph \
      --attention ${a%%:*} ${DATA:+--data $DATA} ${PROFILE:+--profile --profile-steps 5} ${EXTRA:-} \
      --out /tmp/$name > "$OUT/$name.log" 2>&1
  done; done
  for t in ${BUDGETS:-4096 16384}; do for a in ${ATTNS:-sdpa triton}; do
    name=am_${t}_${a/:/_}
    row=$(grep -E '^graph ' "$OUT/$name.log" | cut -c1-100)
    printf "%6s %-22s %s\n" $t $a "${row:-failed (see $name.log)}"
    [ -n "${PROFILE:-}" ] && grep -E "by family" -A10 "$OUT/$name.log" | cut -c1-150 | head -12
  done; done
}
# Time to BLEU of several recipe variants at once, one GPU each (ttb-budgets, ttb-variants): DIR PLOT VARIANT...,
# a VARIANT being NAME or NAME:FLAG,FLAG (flags written --flag=value); TIME, PAIRS, TTB, PART, EXTRA as those parts say.
ttb_variants() {
  local dir=$1 plot=$2; shift 2
  local V=("$@") T=${TIME:-8m} D=${TTB:-$dir}_${PAIRS:-1000000}
  local C=$D/corpus
  local gpus; gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  if [[ " ${EXTRA:-} " != *" --device cpu "* ]] && [ "${#V[@]}" -gt "$gpus" ]; then
    echo "ttb: ${#V[@]} runs but $gpus GPUs (one GPU each; a run without one would train on the CPU)"
    return 1
  fi
  [ -d $C ] || python3 scripts/make_longtail.py --out $C --pairs ${PAIRS:-1000000} > "$OUT/ttb_corpus.txt"
  python3 -c "import sys; from streamnmt.data import DataConfig, prepare_data
prepare_data(DataConfig(data=sys.argv[1]), log=print)" $C > "$OUT/ttb_prepare.log" 2>&1
  local i run extra flags runs=() v
  for i in "${!V[@]}"; do
    run=${V[$i]%%:*}; extra=(); [ "${V[$i]#*:}" != "${V[$i]}" ] && IFS=, read -ra extra <<< "${V[$i]#*:}"
    flags=(--data $C --project $D --name $run "${extra[@]}" ${EXTRA:-})
    [ "${PART:-1}" = 2 ] && flags=(--resume $D/$run/weights/last.pt)
    CUDA_VISIBLE_DEVICES=$i timeout 590 python3 -m streamnmt train "${flags[@]}" --time-limit "$T" \
      >> "$OUT/ttb_$run.log" 2>&1 &
  done
  wait
  for v in "${V[@]}"; do
    run=${v%%:*}
    cp $D/$run/evals.csv "$OUT/ttb_${run}_evals.csv" 2>/dev/null && runs+=("$D/$run=$run")
    echo "== $run"; grep -E "^recipe:|^model:|wall [0-9]+ s|^done|rror" "$OUT/ttb_$run.log" | cut -c1-200
  done
  python3 scripts/plot_time_to_bleu.py "${runs[@]}" --out "$OUT/$plot"
}
case "$1" in
  table)
    python3 -m streamnmt bench --batch-size 32 --max-len 32 --pad-multiple 32 --repeats 3 --profile \
      --out /tmp/b32 > "$OUT/bench32.log" 2>&1
    cp /tmp/b32/bench.json "$OUT/bench32.json"; cp /tmp/b32/bench.png "$OUT/bench32.png"
    cp /tmp/b32/timeline.png "$OUT/timeline32.png"; tail -25 "$OUT/bench32.log"
    python3 -m streamnmt bench --batch-size 128 --max-len 128 --pad-multiple 128 --repeats 3 \
      --out /tmp/b128 > "$OUT/bench128.log" 2>&1
    cp /tmp/b128/bench.json "$OUT/bench128.json"; cp /tmp/b128/bench.png "$OUT/bench128.png"
    tail -20 "$OUT/bench128.log" ;;
  tests)
    python3 -m pytest -m gpu tests -q -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1; tail -15 "$OUT/gpu_tests.log"
    python3 -m streamnmt train --sync-strategy graph --epochs ${EPOCHS:-12} --project /tmp/runs --name bleu \
      > "$OUT/train_bleu.log" 2>&1
    cp /tmp/runs/bleu/results.csv "$OUT/bleu_results.csv"; cp /tmp/runs/bleu/results.png "$OUT/bleu_results.png"
    grep -E "^ +[0-9]+/|graph mode|done" "$OUT/train_bleu.log"
    python3 -m streamnmt eval --weights /tmp/runs/bleu/weights/best.pt --split test 2>&1 | tail -3 ;;
  compile)
    timeout 330 python3 -m streamnmt bench --batch-size 128 --max-len 128 --pad-multiple 128 --repeats 3 --compile \
      --strategies graph,resident-graph,full --no-references --out /tmp/bc > "$OUT/bench128c.log" 2>&1
    cp /tmp/bc/bench.json "$OUT/bench128c.json"; tail -12 "$OUT/bench128c.log"
    timeout 240 python3 scripts/bench_loader.py --dir /tmp/c1m --out "$OUT/loader.json" --tokenizer-sample 150000 \
      > "$OUT/loader.log" 2>&1
    tail -15 "$OUT/loader.log" ;;
esac
case "$1" in
  soak)
    timeout 300 python3 scripts/soak.py --steps ${SOAK_STEPS:-3000} --strategies ${SOAK_STRATEGIES:-baseline,event,interval,deep,full,graph} \
      --out "$OUT/soak.json" 2>&1 | grep -v Warning
    for b in 256 512; do
      timeout 120 python3 scripts/bench_decode.py --batch-size $b --dtype float32 --only beam --repeats 3 \
        --out "$OUT/decode_fp32_$b.json" 2>&1 | tail -6
    done ;;
esac
case "$1" in
  peer)  # the compile-ro peer beside graph mode and the eager strategies, 32x32; graph with --compile
    timeout 420 python3 -m streamnmt bench --batch-size 32 --max-len 32 --pad-multiple 32 --repeats 3 \
      --strategies full,graph,compile-ro --out /tmp/p32 > "$OUT/peer32.log" 2>&1; tail -14 "$OUT/peer32.log"
    timeout 300 python3 -m streamnmt bench --batch-size 32 --max-len 32 --pad-multiple 32 --repeats 3 --compile \
      --strategies graph --out /tmp/p32c > "$OUT/peer32c.log" 2>&1; tail -10 "$OUT/peer32c.log" ;;
  longtail)  # token-budget batches over a heavy-tailed corpus: graph mode vs its resident limit
    python3 scripts/make_longtail.py --out /tmp/lt --pairs 100000
    timeout 200 python3 -m streamnmt bench --data /tmp/lt --max-tokens 8192 --max-len 128 --repeats 3 \
      --strategies graph,resident-graph --no-references --steps 200 --out /tmp/lt8k > "$OUT/longtail.log" 2>&1
    tail -8 "$OUT/longtail.log" ;;
esac
case "$1" in
  check)  # the GPU tests, with the 10,000-step soak of full and graph beside them (memory, not speed)
    (timeout 560 python3 scripts/soak.py --steps 10000 --early 1000 --strategies graph,full \
      --out "$OUT/soak.json" > "$OUT/soak.log" 2>&1 &)
    timeout ${TEST_S:-330} python3 -m pytest -m gpu -q -p no:cacheprovider -rs --durations=12 tests/test_decode_gpu.py \
      tests/test_recipe_gpu.py tests/engine/test_graphs_gpu.py tests/engine/test_engine_gpu.py \
      tests/test_reliability_gpu.py tests/test_dist_gpu.py > "$OUT/gpu_tests.log" 2>&1
    tail -25 "$OUT/gpu_tests.log" ;;
  recipe2)  # the recipe and the earlier defaults side by side (concurrently: the same share of the GPU)
    (OUT=$OUT BUDGET=${BUDGET:-60s} SAVE_EVERY=${SAVE_EVERY:-1000} bash scripts/recipe_compare.sh baseline \
      > "$OUT/recipe_baseline.txt" 2>&1 &)
    OUT=$OUT BUDGET=${BUDGET:-60s} SAVE_EVERY=${SAVE_EVERY:-1000} bash scripts/recipe_compare.sh recipe \
      > "$OUT/recipe_recipe.txt" 2>&1
    while pgrep -f "name baseline" > /dev/null || pgrep -f "runs/baseline" > /dev/null; do sleep 2; done
    cat "$OUT/recipe_baseline.txt" "$OUT/recipe_recipe.txt" ;;
esac
case "$1" in
  scaling)  # multi-GPU scaling (nvidia-h200-x2; -x4 with NPROC=1,2,4): base bf16, rows full and graph, per-GPU
            # tok/s and efficiency vs 1 GPU, at SIZE x SIZE (32, then SIZE=128); at 32 also one --profile at 2 GPUs
    N=${NPROC:-1,2}; S=${SIZE:-32}
    timeout 300 python3 -m streamnmt bench --model base --amp bf16 --batch-size $S --max-len $S --pad-multiple $S \
      --repeats 3 --strategies full,graph --no-references --nproc $N --out /tmp/s$S > "$OUT/scaling$S.log" 2>&1
    cp /tmp/s$S/bench.json "$OUT/scaling$S.json"; cp /tmp/s$S/bench.csv "$OUT/scaling$S.csv"
    cp /tmp/s$S/bench.png "$OUT/scaling$S.png"; tail -14 "$OUT/scaling$S.log"
    for d in /tmp/s$S/nproc*; do cp "$d/bench.json" "$OUT/scaling${S}_$(basename "$d").json"; done
    if [ "$S" = 32 ]; then
      timeout 160 python3 -m streamnmt bench --model base --amp bf16 --batch-size 32 --max-len 32 --pad-multiple 32 \
        --repeats 1 --strategies full,graph --no-references --nproc 2 --profile --out /tmp/sp \
        > "$OUT/scaling_profile.log" 2>&1
      cp /tmp/sp/timeline.png "$OUT/scaling_timeline2.png"; cp /tmp/sp/bench.json "$OUT/scaling_profile.json"
      grep -E "GPU busy|nccl all-reduce|kernels \(count" "$OUT/scaling_profile.log"
      timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_bench_dist.py 2>&1 | tail -4
    fi ;;
  scaling-compile)  # the same with --compile (each rank compiles each row once: minutes); SIZE=32, then 128
    N=${NPROC:-1,2}; S=${SIZE:-32}
    timeout 540 python3 -m streamnmt bench --model base --amp bf16 --batch-size $S --max-len $S --pad-multiple $S \
      --repeats 3 --compile --strategies full,graph --no-references --nproc $N --out /tmp/sc$S \
      > "$OUT/scaling${S}c.log" 2>&1
    cp /tmp/sc$S/bench.json "$OUT/scaling${S}c.json"; cp /tmp/sc$S/bench.csv "$OUT/scaling${S}c.csv"
    for d in /tmp/sc$S/nproc*; do cp "$d/bench.json" "$OUT/scaling${S}c_$(basename "$d").json"; done
    tail -14 "$OUT/scaling${S}c.log" ;;
esac
case "$1" in
  ddp|ddp-128)  # one-rank DDP (torchrun, NCCL) vs plain graph mode, same lease: ddp = the one-GPU DDP tests and
                # the bench at 32x32; ddp-128 = the bench at 128x128. Targets: DDP keeps >= 85 % (32), >= 95 % (128)
    if [ "$1" = ddp ]; then
      timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider -rs --durations=8 tests/test_ddp_gpu.py \
        > "$OUT/ddp_tests.log" 2>&1; tail -12 "$OUT/ddp_tests.log"; S=32
    else S=128; fi
    B="--batch-size $S --max-len $S --pad-multiple $S --repeats 3 --strategies graph --no-references"
    timeout 90 python3 -m streamnmt bench $B --out /tmp/ddp_plain$S > "$OUT/ddp_plain$S.log" 2>&1
    timeout 90 python3 -m streamnmt bench $B --nproc 1 --out /tmp/ddp_one$S > "$OUT/ddp_one$S.log" 2>&1
    cp /tmp/ddp_plain$S/bench.json "$OUT/ddp_plain$S.json"; cp /tmp/ddp_one$S/bench.json "$OUT/ddp_one$S.json"
    grep -hE "graph mode|capture failed|error" "$OUT/ddp_plain$S.log" "$OUT/ddp_one$S.log" | sort | uniq -c
    python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"{'size':>8} {'graph tok/s':>12} {'1-rank DDP tok/s':>17} {'ratio':>7} {'target':>7}")
for s, target in ((32, 0.85), (128, 0.95)):
    try:
        plain, one = (next(r for r in json.loads((out / f"ddp_{k}{s}.json").read_text())["summary"]
                           if r["name"] == "graph")["tokens_per_s"] for k in ("plain", "one"))
    except (OSError, StopIteration, KeyError, ValueError):
        continue
    ratio = one / plain
    print(f"{s}x{s:<5} {plain:>12,.0f} {one:>17,.0f} {100 * ratio:>6.1f}% {'>=' + str(round(100 * target)):>6}%"
          f" {'ok' if ratio >= target else 'MISSED'}")
PY
    ;;
  pipeline)  # the seeds' predictions: every strategy at 32x32 (3 repeats, profiled), deep/full with 3 streams,
             # the deep row's timeline (copies of N+1, N+2 on streams 0 and 3 over the compute); table last
    timeout 260 python3 -m streamnmt bench --batch-size 32 --max-len 32 --pad-multiple 32 --repeats 3 --profile \
      --strategies baseline,event,interval,deep,full,graph --no-references --out /tmp/pl > "$OUT/pipeline.log" 2>&1
    timeout 80 python3 -m streamnmt bench --batch-size 32 --max-len 32 --pad-multiple 32 --repeats 3 --streams 3 \
      --strategies baseline,deep,full --no-references --out /tmp/pl3 > "$OUT/pipeline3.log" 2>&1
    python3 scripts/seed_predictions.py /tmp/pl --streams3 /tmp/pl3 --timeline deep > "$OUT/predictions.md" 2>&1
    cp /tmp/pl/bench.json "$OUT/pipeline.json"; cp /tmp/pl3/bench.json "$OUT/pipeline3.json"
    cp /tmp/pl/timeline.png "$OUT/pipeline_timeline.png"; cp /tmp/pl/timeline_deep.png "$OUT/timeline_deep.png"
    tail -12 "$OUT/pipeline.log"; cat "$OUT/predictions.md" ;;
  pipeline-tests)  # the engine's GPU tests: schedules == baseline (MLP, Transformer fp32), sanitizer, memory
    timeout 340 python3 -m pytest -m gpu -q -p no:cacheprovider -rs --durations=8 tests/engine/test_engine_gpu.py \
      > "$OUT/pipeline_tests.log" 2>&1; tail -25 "$OUT/pipeline_tests.log" ;;
  decode)  # streamnmt eval end to end vs bench_decode's graph-cached rate (bf16, beam 3, batch 64, same sources),
           # then fp32 cached vs uncached at batch 256 (beam 3); 3 repeats each
    timeout 200 python3 scripts/bench_eval.py --batch-size 64 --beam 3 --dtype bf16 --repeats 3 --dir /tmp/bench_eval_dir \
      --out "$OUT/eval_vs_bench.json" > "$OUT/eval_vs_bench.log" 2>&1
    timeout 140 python3 scripts/bench_decode.py --batch-size 256 --dtypes float32 --beams 3 \
      --variants graph,eager,uncached --repeats 3 --out "$OUT/decode_fp32_256.json" > "$OUT/decode_fp32_256.log" 2>&1
    tail -4 "$OUT/decode_fp32_256.log"; tail -5 "$OUT/eval_vs_bench.log" ;;
  packing)  # packed batches (one shape) vs length buckets vs the compile-ro peer at the packed shape, sdpa vs
            # flex, on the built-in and the long-tail corpus; base, bf16, vocabulary 32k; then the compile time
    B="python3 -m streamnmt bench --model base --amp bf16 --vocab 32000 --max-tokens ${TOKENS:-16384} --max-len 128"
    [ -d /tmp/lt ] || python3 scripts/make_longtail.py --out /tmp/lt --pairs 100000 > /dev/null
    for corpus in builtin longtail; do
      D=""; [ $corpus = longtail ] && D="--data /tmp/lt"
      timeout 290 $B $D --strategies graph,compile-ro --no-references --out /tmp/pk_$corpus \
        > "$OUT/pack_${corpus}.log" 2>&1
      timeout 290 $B $D --no-pack --strategies graph --no-references --out /tmp/pk_${corpus}_buckets \
        > "$OUT/pack_${corpus}_buckets.log" 2>&1
      timeout 290 $B $D --attention flex --strategies graph --no-references --out /tmp/pk_${corpus}_flex \
        > "$OUT/pack_${corpus}_flex.log" 2>&1
      for f in "" _buckets _flex; do cp /tmp/pk_$corpus$f/bench.json "$OUT/pack_$corpus$f.json" 2>/dev/null; done
    done
    timeout 290 $B --compile --strategies graph --no-references --repeats 1 --steps 50 --out /tmp/pk_compile \
      > "$OUT/pack_compile.log" 2>&1
    for f in "$OUT"/pack_*.log; do
      echo "== $(basename "$f" .log): $(grep -o 'padding [0-9.]* % of the target positions' "$f" | head -1)"
      grep -E "ready in" "$f"
      grep -E "^(graph|compile-ro) " "$f" | cut -c1-120
    done ;;
  packed-profile)  # where a packed base-model step's time goes (kernel families, top kernels), then graph
                   # --compile and the compile-ro peer at the same shape, each row in its own process
    B="python3 -m streamnmt bench --model base --amp bf16 --vocab 32000 --max-tokens ${TOKENS:-16384} --max-len 128"
    timeout 240 $B --strategies graph --repeats 3 --profile --profile-steps 5 --no-references --out /tmp/pp \
      > "$OUT/pp_graph.log" 2>&1
    timeout 240 $B --strategies graph --compile --repeats 3 --no-references --out /tmp/ppc > "$OUT/pp_compile.log" 2>&1
    timeout 240 $B --strategies compile-ro --repeats 3 --no-references --out /tmp/ppr > "$OUT/pp_ro.log" 2>&1
    for f in pp_graph pp_compile pp_ro; do
      echo "== $f"; grep -E "ready in|^(graph|compile-ro) " "$OUT/$f.log" | cut -c1-140
    done
    grep -E "by family|kernels in the window" -A13 "$OUT/pp_graph.log" | cut -c1-150 | head -16 ;;
  targets)  # the packed-training targets in one lease: graph --compile beside the compile-ro and stock-ro
             # peers (each peer in a child bench), graph mode uncompiled, length buckets; built-in corpus
    B="python3 -m streamnmt bench --model base --amp bf16 --vocab 32000 --max-tokens ${TOKENS:-16384} --max-len 128"
    B="$B --no-references --repeats 3"
    timeout 330 $B --compile --strategies graph,compile-ro,stock-ro --out /tmp/tg_c > "$OUT/tg_compile.log" 2>&1
    timeout 120 $B --strategies graph --out /tmp/tg_g > "$OUT/tg_graph.log" 2>&1
    timeout 120 $B --no-pack --strategies graph --out /tmp/tg_b > "$OUT/tg_buckets.log" 2>&1
    for f in compile graph buckets; do
      cp /tmp/tg_${f:0:1}/bench.json "$OUT/tg_$f.json" 2>/dev/null
      echo "== $f"; grep -E "ready in|compiled|^(graph|compile-ro|stock-ro) " "$OUT/tg_$f.log" | cut -c1-140
    done ;;
  knobs)  # graph --compile, one row per Inductor setting in KNOBS (NAME=VALUE words; "-" = as committed), then
          # the long-tailed corpus as committed; each row its own process
    B="python3 -m streamnmt bench --model base --amp bf16 --vocab 32000 --max-tokens ${TOKENS:-16384} --max-len 128"
    B="$B --no-references --repeats 3 --compile --strategies graph"
    [ -d /tmp/lt ] || python3 scripts/make_longtail.py --out /tmp/lt --pairs 100000 > /dev/null
    i=0
    for k in ${KNOBS:-- TORCHINDUCTOR_MIX_ORDER_REDUCTION=1}; do
      i=$((i + 1)); e=(); [ "$k" != - ] && e=("$k")
      timeout 150 env "${e[@]}" $B --out /tmp/kn$i > "$OUT/knob$i.log" 2>&1
      echo "== $k"; grep -E "ready in|^graph " "$OUT/knob$i.log" | cut -c1-140
    done
    timeout 170 $B --data /tmp/lt --out /tmp/kn_lt > "$OUT/knob_lt.log" 2>&1
    echo "== long-tailed"; grep -E "ready in|^graph " "$OUT/knob_lt.log" | cut -c1-140 ;;
  budgets)  # graph --compile at each token budget in BUDGETS (the trainer's default is 4096 since f5f05bd), the
            # built-in then the long-tailed corpus; each row its own process, ~80 s a row
    B="python3 -m streamnmt bench --model base --amp bf16 --vocab 32000 --max-len 128"
    B="$B --no-references --repeats 3 --compile --strategies graph"
    [ -d /tmp/lt ] || python3 scripts/make_longtail.py --out /tmp/lt --pairs 100000 > /dev/null
    for corpus in ${CORPORA:-builtin longtail}; do for t in ${BUDGETS:-8192 16384 32768}; do
      D=""; [ $corpus = longtail ] && D="--data /tmp/lt"
      timeout 190 $B $D --max-tokens $t --out /tmp/bu_${corpus}_$t > "$OUT/budget_${corpus}_$t.log" 2>&1
      echo "== $corpus $t: $(grep -o 'ready in [0-9.]* s' "$OUT/budget_${corpus}_$t.log" | tail -1)"
      grep -E "^graph " "$OUT/budget_${corpus}_$t.log" | cut -c1-90
    done; done ;;
  attn-triton)  # #31: the Triton segment kernels (--attention triton): their GPU tests, attention alone against
                # SDPA (scripts/bench_attention.py at 16384 and at the default 4096, at the tile settings in TILES),
                # then the packed base model with each attention at the default budget, built-in corpus (graph
                # --compile, 32k vocabulary; MODEL_TILES=QxK-wW-sS for the kernels' tiles there; PROFILE=1 adds
                # the kernel families of a profiled window)
    timeout 240 python3 -m pytest -q -m gpu tests/test_segattn_triton.py -p no:cacheprovider > "$OUT/attn_tests.log" 2>&1
    tail -3 "$OUT/attn_tests.log"
    for t in 16384 4096; do
      timeout 240 python3 scripts/bench_attention.py builtin ${TILES:-triton,triton-64x32-w8,triton-32x32-w2,triton-64x64-w8,triton-16x32-w2} 2 $t \
        > "$OUT/attn_bench_$t.log" 2>&1
      # ms of one step's attention (6 layers x 3, forward + backward) per batch: eager / replayed from a graph
      echo "== attention alone, $t tokens: ms eager / graph per batch"; python3 - "$OUT/attn_bench_$t.log" <<'PY'
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if x.startswith("{")]
for k in [k for k in rows[0] if k in ("sdpa",) or (k.startswith("triton") and "_" not in k)]:
    print(f"{k:<18}", "  ".join(f"{r[k]:7.2f} / {r.get(k + '_graph', float('nan')):6.2f}" if isinstance(r[k], float)
                                  else str(r[k])[:80] for r in rows), rows[-1].get(k + "_visited", ""))
PY
    done
    BUDGETS=${TOKENS:-4096} ATTNS=${ATTNS:-"sdpa triton${MODEL_TILES:+:$MODEL_TILES}"} attn_model ;;
  attn-model)  # #31: the packed base model (graph --compile, bf16, 32k vocabulary, built-in corpus) at each
               # budget in BUDGETS with each attention in ATTNS: sdpa, triton, triton:QxK-wW-sS (the kernels'
               # tiles) or auto; 3 repeats each, one process per row; the table last. UNCOMPILED=" ": graph mode
               # without --compile (what --compile auto leaves a short run); LONGTAIL=N: a long-tailed corpus of N
               # pairs (scripts/make_longtail.py) instead of the built-in one; EXTRA: more bench flags for every row
               # (e.g. --tie-embeddings decoder); PROFILE=1: the kernel families of a profiled window
    attn_model ;;
  attn-ttb)  # #31: does the model train alike with --attention triton? sdpa and triton side by side on one GPU
             # (the same share each), built-in corpus, the defaults, --time-limit TIME (100s); then the steps,
             # the best dev BLEU, and the mean training nll over the steps both made, in their last fifth
    for a in sdpa triton; do
      timeout 300 python3 -m streamnmt train --attention $a --time-limit ${TIME:-100s} --project /tmp/attb --name $a \
        --exist-ok > "$OUT/attb_$a.log" 2>&1 &
      sleep 1
    done
    wait
    grep -hE "^recipe:|wall [0-9]+ s" "$OUT"/attb_*.log | cut -c1-160
    python3 - <<'PY'
import csv
runs = {a: (list(csv.DictReader(open(f"/tmp/attb/{a}/steps.csv"))), list(csv.DictReader(open(f"/tmp/attb/{a}/evals.csv"))))
        for a in ("sdpa", "triton")}
common = min(len(s) for s, _ in runs.values())
for a, (steps, evals) in runs.items():
    tail = steps[common * 4 // 5:common]
    nll = sum(float(r["nll"]) for r in tail) / max(len(tail), 1)
    bleu = max([float(e["bleu"]) for e in evals if e["bleu"]], default=float("nan"))
    span = f"{tail[0]['step']}-{tail[-1]['step']}" if tail else "none"
    print(f"{a:<7} steps {len(steps):>6}  best dev BLEU {bleu:6.2f}  nll over steps {span}: {nll:.4f}")
PY
    ;;
  recipe-defaults)  # time-to-BLEU: the defaults vs --max-tokens 6144 --warmup 800, the same --time-limit each
    # (the two runs of a corpus share the GPU concurrently: the same share each), built-in then long-tail
    # corpus (CORPORA=longtail: that one only); then dev BLEU of last.pt with streamnmt eval. TIME=100s each;
    # the whole part ~7-8 min.
    T=${TIME:-100s}
    python3 scripts/make_longtail.py --out /tmp/ltlex --pairs ${LT_PAIRS:-100000} > "$OUT/rd_longtail.txt"
    for corpus in ${CORPORA:-builtin longtail}; do
      data=(); [ $corpus = longtail ] && data=(--data /tmp/ltlex)
      # prepare the corpus and tokenizers once, so that the two concurrent runs only read the cache
      python3 -c "import sys; from streamnmt.data import DataConfig, prepare_data
prepare_data(DataConfig(data=sys.argv[1] or None, builtin_size=40000), log=print)" "${data[1]:-}" \
        > "$OUT/rd_${corpus}_prepare.log" 2>&1
      common=(--model base --epochs 1000 --time-limit "$T" --bleu-samples 0 --project /tmp/rd --exist-ok "${data[@]}")
      (timeout 330 python3 -m streamnmt train "${common[@]}" --name ${corpus}_handset --max-tokens 6144 --warmup 800 \
        > "$OUT/rd_${corpus}_handset.log" 2>&1 &)
      sleep 1
      timeout 330 python3 -m streamnmt train "${common[@]}" --name ${corpus}_defaults > "$OUT/rd_${corpus}_defaults.log" 2>&1
      while pgrep -f "name ${corpus}_handset" > /dev/null; do sleep 2; done
      (timeout 120 python3 -m streamnmt eval --weights /tmp/rd/${corpus}_handset/weights/last.pt --split dev \
        > "$OUT/rd_${corpus}_handset_eval.log" 2>&1 &)
      timeout 120 python3 -m streamnmt eval --weights /tmp/rd/${corpus}_defaults/weights/last.pt --split dev \
        > "$OUT/rd_${corpus}_defaults_eval.log" 2>&1
      while pgrep -f "rd/${corpus}_handset/weights" > /dev/null; do sleep 1; done
    done
    grep -h "^recipe:" "$OUT"/rd_*_defaults.log
    # tokens: real target tokens trained within the budget; train_nll: mean over the second half of the steps
    printf "%-9s %-9s %10s %7s %7s %12s %9s %7s\n" corpus run max_tokens warmup steps tokens train_nll "dev BLEU"
    for corpus in ${CORPORA:-builtin longtail}; do for run in defaults handset; do
      d=/tmp/rd/${corpus}_$run
      python3 - "$d" "$corpus" "$run" "$OUT/rd_${corpus}_${run}_eval.log" <<'PY'
import csv, re, sys, yaml
d, corpus, run, ev = sys.argv[1:]
cfg = yaml.safe_load(open(f"{d}/config.yaml"))
steps = list(csv.DictReader(open(f"{d}/steps.csv")))
tail = steps[len(steps) // 2:]  # the second half: past warm-up
tok = sum(int(r["tokens"]) for r in steps)
m = re.search(r"BLEU = ([0-9.]+)", open(ev).read())
nll = sum(float(r["nll"]) for r in tail) / max(len(tail), 1)
print(f"{corpus:<9} {run:<9} {cfg['data']['max_tokens']:>10} {cfg['optim']['warmup']:>7} {len(steps):>7} "
      f"{tok:>12} {nll:>9.3f} {m.group(1) if m else 'n/a':>7}")
PY
    done; done ;;
esac
case "$1" in
  wall)  # where a 120-s run's wall clock goes, and time to BLEU against an earlier tree's 360-s run on the
         # same corpus (BASE: a source tree of that commit, e.g. `git archive 46a1d58 src | tar -x -C .base`)
    python3 scripts/make_longtail.py --out /tmp/lt40 --pairs 40000 > /dev/null
    cp -r /tmp/lt40 /tmp/lt40new  # the trees' tokenized caches apart (the tokenizers train once per copy)
    if [ -n "${BASE:-}" ]; then
      (cd /tmp && PYTHONPATH=$OLDPWD/$BASE/src STREAMNMT_HOME=/tmp/snhome_base timeout 450 python3 -m streamnmt train \
        --data /tmp/lt40 --time-limit ${BASE_T:-360s} --project /tmp/runs --name base_lt > "$OUT/wall_base_lt.log" 2>&1)
      grep -E "^ +[0-9]+/|time limit|recipe|engine:" "$OUT/wall_base_lt.log" | tail -6
    fi
    t0=$(date +%s%N); timeout 200 python3 -m streamnmt train --data /tmp/lt40new --time-limit 120s \
      --project /tmp/runs --name new_lt 2>&1 | python3 -u scripts/stamp.py > "$OUT/wall_new_lt.log"
    echo "$(( ($(date +%s%N) - t0) / 1000000 )) ms wall (outside)" >> "$OUT/wall_new_lt.log"
    grep -E "wall|time limit|recipe|eval:|engine:|data: ready|run dir|outside" "$OUT/wall_new_lt.log"
    grep -E "^ *[0-9.]+ +[0-9]+ +[0-9.]+G" "$OUT/wall_new_lt.log" | (head -2; tail -2)
    for r in /tmp/runs/*_lt; do n=$(basename $r); cp $r/evals.csv "$OUT/${n}_evals.csv"; cp $r/results.csv "$OUT/${n}_results.csv"; done
    timeout 60 python3 scripts/bench_train_eval.py /tmp/runs/new_lt --out "$OUT/train_eval_lt.json" ;;
  wall2)  # the same 120-s run on the built-in corpus; checkpoint stalls (async against sync), base, vocab 32k
    t0=$(date +%s%N); timeout 200 python3 -m streamnmt train --time-limit 120s \
      --project /tmp/runs --name new_builtin 2>&1 | python3 -u scripts/stamp.py > "$OUT/wall_new_builtin.log"
    echo "$(( ($(date +%s%N) - t0) / 1000000 )) ms wall (outside)" >> "$OUT/wall_new_builtin.log"
    grep -E "wall|time limit|recipe|eval:|engine:|data: ready|run dir|outside" "$OUT/wall_new_builtin.log"
    grep -E "^ *[0-9.]+ +[0-9]+ +[0-9.]+G" "$OUT/wall_new_builtin.log" | (head -2; tail -2)
    cp /tmp/runs/new_builtin/evals.csv "$OUT/new_builtin_evals.csv"
    cp /tmp/runs/new_builtin/results.csv "$OUT/new_builtin_results.csv"
    timeout 60 python3 scripts/bench_train_eval.py /tmp/runs/new_builtin --out "$OUT/train_eval_builtin.json"
    timeout 150 python3 scripts/bench_checkpoint.py --repeats 5 --out "$OUT/bench_checkpoint.json" ;;
  wall3)  # `train --time-limit 120s` at the defaults: built-in corpus on a fresh machine (cold caches), the
          # same command again (page cache, data, tokenizers and Triton kernels warm), then the long-tailed 40k
    python3 scripts/make_longtail.py --out /tmp/lt40 --pairs 40000 > /dev/null
    for run in builtin_cold builtin_warm lt40; do
      data=""; [ "$run" = lt40 ] && data="--data /tmp/lt40"
      t0=$(date +%s%N); timeout 200 python3 -m streamnmt train $data --time-limit 120s --project /tmp/runs \
        --name $run 2>&1 | python3 -u scripts/stamp.py > "$OUT/wall_$run.log"
      echo "$(( ($(date +%s%N) - t0) / 1000000 )) ms wall (outside)" >> "$OUT/wall_$run.log"
      cp /tmp/runs/$run/evals.csv "$OUT/${run}_evals.csv"
    done
    for run in builtin_cold builtin_warm lt40; do  # the end line and the set-up's stamped milestones
      echo "== $run"; grep -E "^ *[0-9.]+ .*(wall [0-9]+ s|set-up [0-9]|data: ready|engine: compile|graph mode|first evaluation|outside)" \
        "$OUT/wall_$run.log" | cut -c1-160
    done ;;
esac
case "$1" in
  multigpu-tests)  # every 2-GPU test (NCCL): equality by sentences and packed, no hidden syncs, the killed rank
                   # and resume on 2 and 1 GPUs, the bench's 2-GPU rows (a test past 150 s dumps its stacks)
    timeout ${TEST_S:-450} python3 -m pytest -m "gpu and multigpu" -v -s -p no:cacheprovider -o faulthandler_timeout=150 \
      -rs --tb=short --durations=12 tests > "$OUT/multigpu_tests.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|SKIPPED|kill to launcher|passed|failed" "$OUT/multigpu_tests.log" | cut -c1-200 | tail -30 ;;
  scaling-packed)  # base, bf16, vocabulary 32k, packed at the H100's default budget (TOKENS=4096), graph mode:
                   # 1 vs 2 GPUs uncompiled, one profiled 2-GPU run (all-reduce hidden behind the backward), then
                   # the same with --compile
    B="python3 -m streamnmt bench --model base --amp bf16 --vocab 32000 --max-tokens ${TOKENS:-4096} --max-len 128"
    B="$B --no-references --strategies graph"
    timeout 200 $B --repeats 3 --nproc 1,2 --out /tmp/spk > "$OUT/spk.log" 2>&1
    timeout 120 $B --repeats 1 --nproc 2 --profile --out /tmp/spk_prof > "$OUT/spk_prof.log" 2>&1
    timeout ${COMPILE_S:-240} $B --repeats 3 --compile --nproc 1,2 --out /tmp/spkc > "$OUT/spkc.log" 2>&1
    cp /tmp/spk/bench.json "$OUT/spk.json"; cp /tmp/spkc/bench.json "$OUT/spkc.json" 2>/dev/null
    cp /tmp/spk_prof/timeline.png "$OUT/spk_timeline2.png" 2>/dev/null
    echo "== uncompiled"; tail -8 "$OUT/spk.log"
    echo "== profile, 2 GPUs"; grep -E "GPU busy|all-reduce|nccl all-reduce" "$OUT/spk_prof.log" | cut -c1-160
    echo "== --compile"; tail -8 "$OUT/spkc.log" ;;
esac
case "$1" in
  gpu-tests)  # every one-GPU test on GPU ${GPU:-0} (on a machine of two GPUs the other can run a part beside it)
    CUDA_VISIBLE_DEVICES=${GPU:-0} timeout ${TEST_S:-540} python3 -m pytest -m "gpu and not multigpu" -v -p no:cacheprovider \
      -o faulthandler_timeout=150 -rs --tb=short --durations=15 tests > "$OUT/gpu_tests.log" 2>&1
    grep -E "FAILED|ERROR|passed|failed|SKIPPED" "$OUT/gpu_tests.log" | cut -c1-220 | tail -30 ;;
  big)  # #30/#31: Transformer-big packed 4,096 compiled beside uncompiled (base compiled as the yardstick), then
        # attention alone at the packed shape in rows of 32-128 (bench_attention widths)
    B="python3 -m streamnmt bench --amp bf16 --vocab 32000 --max-tokens 4096 --max-len 128 --no-references"
    B="$B --strategies graph --repeats 3"
    timeout 260 $B --model big --compile --out /tmp/big_compile > "$OUT/big_compile.log" 2>&1
    timeout 100 $B --model big --out /tmp/big_eager > "$OUT/big_eager.log" 2>&1
    timeout 150 $B --model base --compile --out /tmp/base_compile > "$OUT/base_compile.log" 2>&1
    timeout 100 python3 scripts/bench_attention.py builtin widths 1 > "$OUT/attention_widths.log" 2>&1
    for f in big_compile big_eager base_compile; do
      cp /tmp/$f/bench.json "$OUT/$f.json" 2>/dev/null
      echo "== $f"; grep -E "ready in|^graph " "$OUT/$f.log" | cut -c1-170
    done
    echo "== attention widths"; tail -3 "$OUT/attention_widths.log" | cut -c1-400 ;;
esac
case "$1" in
  ttb2)  # #32: time to BLEU on 1M pairs (make_longtail), `--time-limit ${TIME:-150s}` each: 1 GPU at the defaults,
         # 2 GPUs at the same global batch (--max-tokens 2048 a rank), 2 GPUs at the defaults (2x the batch, the
         # warm-up rule scaling it); RUNS picks some (e.g. RUNS=gpu1, then RUNS="gpu2_same gpu2_double" in a second
         # call on the same machine: the corpus and its cache stay in /tmp). Then the curves and one table.
    # (a CPU smoke test of this part: PAIRS=3000 TIME=20s EXTRA="--device cpu --model tiny" TTB=/tmp/ttb_cpu)
    T=${TIME:-150s}; D=${TTB:-/tmp/ttb}; C=$D/corpus
    [ -d $C ] || python3 scripts/make_longtail.py --out $C --pairs ${PAIRS:-1000000} > "$OUT/ttb_corpus.txt"
    python3 -c "import sys; from streamnmt.data import DataConfig, prepare_data
prepare_data(DataConfig(data=sys.argv[1]), log=print)" $C > "$OUT/ttb_prepare.log" 2>&1
    common=(--data $C --time-limit "$T" --project $D --exist-ok ${EXTRA:-})
    for run in ${RUNS:-gpu1 gpu2_same gpu2_double}; do
      case $run in
        gpu1) flags=(--name gpu1) ;;
        gpu2_same) flags=(--nproc 2 --max-tokens 2048 --name gpu2_same) ;;
        gpu2_double) flags=(--nproc 2 --name gpu2_double) ;;
      esac
      timeout 400 python3 -m streamnmt train "${common[@]}" "${flags[@]}" > "$OUT/ttb_$run.log" 2>&1
      cp $D/$run/evals.csv "$OUT/ttb_${run}_evals.csv" 2>/dev/null
      echo "== $run"; grep -E "^recipe:|wall [0-9]+ s|^done|error" "$OUT/ttb_$run.log" | cut -c1-200
    done
    runs=(); for r in gpu1 gpu2_same gpu2_double; do [ -f $D/$r/evals.csv ] && runs+=($D/$r); done
    python3 scripts/plot_time_to_bleu.py "${runs[@]}" --out "$OUT/time_to_bleu_2gpu.png" ;;
esac
case "$1" in
  ddp-buckets)  # #32's stretch: 1 vs 2 GPUs at the default buckets, then 2 GPUs at each BUCKETS size (MB); base,
                # bf16, vocab 32k, packed 4,096 a rank, graph mode (uncompiled: ~1 min a row)
    B="python3 -m streamnmt bench --model base --amp bf16 --vocab 32000 --max-tokens ${TOKENS:-4096} --max-len 128"
    B="$B --no-references --strategies graph --repeats 3"
    timeout 200 $B --nproc 1,2 --out /tmp/db_ref > "$OUT/db_ref.log" 2>&1
    echo "== 25 MB (default), 1 and 2 GPUs"; grep -E "^graph +[12] " "$OUT/db_ref.log"
    for mb in ${BUCKETS:-50 100 200}; do
      timeout 120 $B --nproc 2 --bucket-cap-mb $mb --out /tmp/db_$mb > "$OUT/db_$mb.log" 2>&1
      echo "== $mb MB, 2 GPUs"; grep -E "^graph " "$OUT/db_$mb.log" | cut -c1-120
    done ;;
esac
case "$1" in
  pack-widths)  # #31: packed rows of WIDTHS target positions on the built-in corpus (every pair fits 32), base,
                # bf16, vocab 32k, TOKENS a batch, graph mode (COMPILE=--compile to compile each row, ~80 s a row)
    B="python3 -m streamnmt bench --model base --amp bf16 --vocab 32000 --max-tokens ${TOKENS:-16384} --max-len 128"
    B="$B --no-references --strategies graph --repeats 3 ${COMPILE:-}"
    for w in ${WIDTHS:-128 64 48 32}; do
      timeout 200 $B --pack-width $w --out /tmp/pw_$w > "$OUT/pw_$w.log" 2>&1
      cp /tmp/pw_$w/bench.json "$OUT/pw_$w.json" 2>/dev/null
      echo "== width $w: $(grep -o 'padding [0-9.]* % of the target positions' "$OUT/pw_$w.log" | head -1)"
      grep -E "^graph " "$OUT/pw_$w.log" | cut -c1-120
    done ;;
esac
case "$1" in
  ttb-ema)  # time to BLEU with the weights' moving average evaluated (--ema D --eval-ema) against the
            # defaults, the same --time-limit each, one after the other (RUNS picks some, EMAS the decays);
            # on the 1M-pair corpus of ttb2 (TTB=/tmp/ttb; made here if absent), where the defaults' dev BLEU
            # moved by up to 17 points from one evaluation to the next at 1d988d6
    T=${TIME:-150s}; D=${TTB:-/tmp/ttb}; C=$D/corpus
    [ -d $C ] || python3 scripts/make_longtail.py --out $C --pairs ${PAIRS:-1000000} > "$OUT/ttb_corpus.txt"
    runs=()
    for run in ${RUNS:-defaults ${EMAS:-ema0.999 ema0.9999}}; do
      flags=(--name $run); [ "${run#ema}" != "$run" ] && flags+=(--ema "${run#ema}" --eval-ema)
      timeout 400 python3 -m streamnmt train --data $C --time-limit "$T" --project $D --exist-ok ${EXTRA:-} \
        "${flags[@]}" > "$OUT/ttb_$run.log" 2>&1
      cp $D/$run/evals.csv "$OUT/ttb_${run}_evals.csv" 2>/dev/null
      echo "== $run"; grep -E "wall [0-9]+ s|^done|error" "$OUT/ttb_$run.log" | cut -c1-200
      runs+=($D/$run)
    done
    python3 scripts/plot_time_to_bleu.py "${runs[@]}" --out "$OUT/time_to_bleu_ema.png" ;;
  setup-split)  # where a run's set-up goes after the set-up changes (one GPU): the 120-s built-in run twice
                # (no TorchDynamo import where nothing compiles), then a 2-GPU run on 1M pairs (TTB corpus)
                # for the packing processes and the DDP construction's seconds in the capture line
    for run in builtin_a builtin_b; do
      t0=$(date +%s%N); timeout 200 python3 -m streamnmt train --time-limit 120s --project /tmp/runs --name $run \
        2>&1 | python3 -u scripts/stamp.py > "$OUT/wall_$run.log"
      echo "$(( ($(date +%s%N) - t0) / 1000000 )) ms wall (outside)" >> "$OUT/wall_$run.log"
      echo "== $run"; grep -E "set-up [0-9]|wall [0-9]+ s|graph mode|outside" "$OUT/wall_$run.log" | cut -c1-220
    done
    if [ -d ${TTB:-/tmp/ttb}/corpus ] && [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
      timeout 200 python3 -m streamnmt train --data ${TTB:-/tmp/ttb}/corpus --nproc 2 --time-limit 60s \
        --project /tmp/runs --name split2 > "$OUT/split2.log" 2>&1
      echo "== 2 GPUs, 1M pairs"; grep -E "set-up [0-9]|graph mode|wall [0-9]+ s" "$OUT/split2.log" | cut -c1-220
    fi ;;
esac
case "$1" in
  first-run)  # a machine's first run: `train --time-limit 25s` (built-in corpus, defaults) with a fresh
              # TRITON_CACHE_DIR, then again warm; BASE=COMMIT runs that tree's src (git archive) beside this one
    python3 -c "from streamnmt.data import DataConfig, prepare_data; prepare_data(DataConfig(), log=print)" \
      > "$OUT/first_run_prep.log" 2>&1
    trees=("tree=src")
    if [ -n "${BASE:-}" ]; then
      rm -rf /tmp/first_base && mkdir -p /tmp/first_base && git archive "$BASE" src | tar -x -C /tmp/first_base
      trees=("base=/tmp/first_base/src" "${trees[@]}")
    fi
    for pass in cold warm; do for t in "${trees[@]}"; do
      name=${t%%=*}_$pass
      TRITON_CACHE_DIR=/tmp/first_triton_${t%%=*} PYTHONPATH=${t#*=} timeout 120 python3 -m streamnmt train \
        --time-limit 25s --project /tmp/first_runs --name $name --exist-ok > "$OUT/first_$name.log" 2>&1
      echo "$name: $(grep -E '^set-up' "$OUT/first_$name.log" | cut -c1-230)"
    done; done ;;
  ttb-budgets)  # #31: time to BLEU per token budget, each BUDGETS entry on its own GPU at once (nvidia-h100-x4 for
                # four), `--time-limit ${TIME:-8m}` (a call lasts 10 minutes at most); PART=2 resumes each run for
                # another TIME (evals.csv's wall_s counts across the resume; the corpus stays in /tmp while the
                # machine is held); then the curves. PAIRS=40000 TIME=120s for the short-corpus comparison.
    # (a CPU smoke test: PAIRS=3000 TIME=20s BUDGETS="256 512" EXTRA="--device cpu --model tiny" TTB=/tmp/ttbb_cpu)
    B=(${BUDGETS:-4096 8192 16384 32768}); V=()
    for b in "${B[@]}"; do V+=("b$b:--max-tokens=$b"); done
    ttb_variants /tmp/ttbb time_to_bleu_budgets.png "${V[@]}" ;;
  ttb-variants)  # #31: time to BLEU per recipe variant, each VARIANTS entry (NAME or NAME:FLAG,FLAG, flags written
                 # --flag=value) on its own GPU at once, the same `--time-limit ${TIME:-8m}` and corpus as ttb-budgets
                 # (PAIRS, TTB; PART=2 resumes); e.g. VARIANTS="defaults tied:--tie-embeddings=decoder
                 # b2048:--max-tokens=2048" on nvidia-h100-x4 (or -x2 for two); then the curves
    ttb_variants /tmp/ttbv time_to_bleu_variants.png ${VARIANTS:-defaults tied:--tie-embeddings=decoder} ;;
  warm-compile)  # #31: the same --compile on run three times with one fresh STREAMNMT_HOME (cold, then warm):
                 # ready after the data, and the first step (scripts/bench_compile_cache.py)
    timeout 500 python3 scripts/bench_compile_cache.py --out "$OUT" --runs ${RUNS:-3} > "$OUT/bcc.log" 2>&1
    tail -8 "$OUT/bcc.log" ;;
  ab-async)  # #29: the 120-s run at the defaults with the BLEU pass on the loop (--async-eval off) and beside
             # training (the default), after a 20-s warm run; CORPUS=lt40 for the long-tailed 40k corpus
    data=""; if [ "${CORPUS:-builtin}" = lt40 ]; then
      python3 scripts/make_longtail.py --out /tmp/lt40 --pairs 40000 > /dev/null; data="--data /tmp/lt40"; fi
    timeout 100 python3 -m streamnmt train $data --time-limit 20s --project /tmp/runs --name warm > "$OUT/wall_warm.log" 2>&1
    runs=$(mktemp -d /tmp/ab_XXXX)  # a fresh project: run names are not taken by an earlier call's
    for mode in ${MODES:-off auto}; do
      t0=$(date +%s%N); timeout 200 python3 -m streamnmt train $data --time-limit 120s --async-eval $mode \
        --project $runs --name $mode 2>&1 | python3 -u scripts/stamp.py > "$OUT/wall_$mode.log"
      echo "$(( ($(date +%s%N) - t0) / 1000000 )) ms wall (outside)" >> "$OUT/wall_$mode.log"
      cp $runs/$mode/evals.csv "$OUT/${mode}_evals.csv"; cp $runs/$mode/results.csv "$OUT/${mode}_results.csv"
      echo "== $mode"; grep -E "set-up [0-9]|wall [0-9]+ s|outside|first evaluation|Traceback|Error" "$OUT/wall_$mode.log" | cut -c1-260
      python3 scripts/ab_summary.py "$OUT/${mode}_evals.csv" "$OUT/${mode}_results.csv"
    done ;;
  ab-120)  # the 120-s built-in run at the defaults: the tree in BASE (e.g. .base/src: `git archive COMMIT src | tar
           # -x -C .base`, carried) against this one, after a 20-s run that makes the corpus and warms the caches;
           # the set-up split and the end line of each
    timeout 100 python3 -m streamnmt train --time-limit 20s --project /tmp/runs --name warm > "$OUT/wall_warm.log" 2>&1
    for run in base new; do
      src=src; [ $run = base ] && src=${BASE:-.base/src}
      t0=$(date +%s%N); PYTHONPATH=$src timeout 200 python3 -m streamnmt train --time-limit 120s --project /tmp/runs \
        --name $run 2>&1 | python3 -u scripts/stamp.py > "$OUT/wall_$run.log"
      echo "$(( ($(date +%s%N) - t0) / 1000000 )) ms wall (outside)" >> "$OUT/wall_$run.log"
      cp /tmp/runs/$run/evals.csv "$OUT/${run}_evals.csv" 2>/dev/null
      echo "== $run"; grep -E "set-up [0-9]|wall [0-9]+ s|graph mode|outside|priming" "$OUT/wall_$run.log" | cut -c1-260
    done ;;
esac
