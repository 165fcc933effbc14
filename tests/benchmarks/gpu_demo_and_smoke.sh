#!/bin/bash
# On the GPU machine (run tool; carry [".whl", ".sgl", and for the smoke test of the CPU-trained demo drafter
# runs/demo/{assets,drafter,train/summary.json,evaluate/evaluate.json}]), in this order, each optional:
#   BENCH="--lengths 16384 --backends flex"  tests/benchmarks/bench_train.py with these arguments
#   DEMO=1         the demo pipeline on the GPU in runs/gpu (DeepSpeed, one rank; reuses a carried demo target)
#   SMOKE=1        serve.smoke for each run in SMOKE_RUNS (default runs/demo) on SMOKE_TARGET (default
#                  runs/demo/assets/target): SGLang baseline vs EAGLE3 on the run's held-out prompts, compared with
#                  the run's reference decoder and offline evaluator (dtype SMOKE_DTYPE). Runs on one target share
#                  the baseline server's measurements (same command, same prompts).
#                  Runs trained elsewhere (e.g. issue 9's two CPU-trained drafters on the DeepseekV3 target) travel
#                  in one carried folder, unpacked here first:
#                    rm -rf runs/gpu-carry; for p in runs/demo-deepseek/assets \
#                        runs/dsv3-{mla,llama}/{drafter,train/summary.json,evaluate/evaluate.json}; do
#                      mkdir -p runs/gpu-carry/$(dirname $p); cp -al $p runs/gpu-carry/$p; done
#                  carry [".whl", ".sgl", "runs/gpu-carry"]; SMOKE=1 SMOKE_TARGET=runs/demo-deepseek/assets/target
#                  SMOKE_RUNS="runs/dsv3-mla runs/dsv3-llama"
#   MLA=1          issue 9 on the GPU: the tiny DeepseekV3 (MLA + MoE) target, the demo-deepseek pipeline for each
#                  drafter arch in MLA_ARCHS (default "llama mla"; one fits a 10-minute command), then serve.smoke
#                  of each drafter on that target
#   PROBE=1        before MLA: tests/benchmarks/probe_sglang_deepseek.py demo (does SGLang serve the demo's
#                  DeepseekV3 target shape at all; ~60 s)
# Results under $OUT/bench.json, $OUT/gpu-demo, $OUT/smoke, $OUT/mla-ARCH.
# SECONDS_LEFT (default 570) is the whole script's budget: every stage's timeout is cut to what is left of it, so
# no stage outlives the script (each `timeout` runs its command in a process group of its own, which an outer
# `timeout` around this script does not reach: a pipeline left running slowed the next command's benchmark).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT/gpu-demo"
END=$(( $(date +%s) + ${SECONDS_LEFT:-570} ))
budget() {  # min(the stage's own limit, seconds left to the script)
  local left=$(( END - $(date +%s) )); (( left < $1 )) && echo $(( left > 1 ? left : 1 )) || echo "$1"
}
source .whl/gpu-env.sh
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader  # should print nothing
smoke() {  # TARGET RUN OUT: SGLang baseline vs EAGLE3 with RUN's drafter on RUN's held-out prompts
  # (at most 8 files come back from $OUT: the report as it is, the server logs and measurements in one archive)
  # one measurements folder per target: a second drafter reuses the baseline server's measurements
  local measured=runs/smoke-gpu/$(echo "$1" | tr / _)
  mkdir -p "$3"
  timeout $(budget ${SMOKE_TIMEOUT:-500}) python3 -m serve.smoke --target "$1" --drafter "$2/drafter" --run "$2" \
    --concurrency 1,8,64 --out "$measured" --timeout 300 \
    --server-arg=--attention-backend=triton --server-arg=--sampling-backend=pytorch \
    --server-arg=--grammar-backend=none --server-arg=--disable-cuda-graph \
    --server-arg=--mem-fraction-static=0.3 --server-arg=--dtype=${SMOKE_DTYPE:-bfloat16} 2>&1 \
    | tr '\r' '\n' | grep -v "^waiting for" | tail -30
  echo "smoke rc=${PIPESTATUS[0]}"
  cp "$measured/report.json" "$3/" 2>/dev/null; tar -C "$measured" -czf "$3/smoke-gpu.tar.gz" .
}
[ -d runs/gpu-carry/runs ] && cp -al runs/gpu-carry/runs .  # runs trained elsewhere, at their own paths
if [ -n "${BENCH:-}" ]; then
  timeout $(budget ${BENCH_TIMEOUT:-300}) python3 tests/benchmarks/bench_train.py $BENCH 2>&1 | grep -v "it/s\]$" | tail -20
fi
if [ "${DEMO:-0}" = 1 ]; then
  timeout $(budget ${DEMO_TIMEOUT:-400}) python3 -m launch.demo --run_dir runs/gpu --extract.nproc_per_node 1 \
    --train.nproc_per_node 1 ${DEMO_ARGS:-} > "$OUT/gpu-demo/demo.log" 2>&1
  echo "demo rc=$?"
  cp runs/gpu/report.json runs/gpu/train/log.jsonl runs/gpu/train/summary.json runs/gpu/evaluate/evaluate.json \
     "$OUT/gpu-demo/" 2>/dev/null
  grep "^\[pipeline\]\|reference decoder" "$OUT/gpu-demo/demo.log"
fi
if [ "${SMOKE:-0}" = 1 ]; then
  for run in ${SMOKE_RUNS:-runs/demo}; do
    ( source .sgl/sglang-env.sh
      smoke ${SMOKE_TARGET:-runs/demo/assets/target} $run "$OUT/smoke-$(basename $run)" )
  done
fi
if [ "${PROBE:-0}" = 1 ]; then
  ( source .sgl/sglang-env.sh; timeout $(budget 200) python3 tests/benchmarks/probe_sglang_deepseek.py demo 2>&1 \
    | grep '^{"variant"' )
fi
if [ "${MLA:-0}" = 1 ]; then
  assets=runs/demo-deepseek/assets
  [ -f $assets/target/config.json ] || python3 -m launch.demo_target --out $assets --arch deepseek_v3 | tail -3
  prev=""
  for arch in ${MLA_ARCHS:-llama mla}; do
    (( END - $(date +%s) > 120 )) || { echo "dsv3 $arch: not started, $(( END - $(date +%s) )) s left"; continue; }
    mkdir -p "$OUT/mla-$arch"
    if [ -n "$prev" ] && [ -f runs/dsv3-$prev/pipeline/extract.json ] && [ ! -e runs/dsv3-$arch/features ]; then
      # the archs share regenerate, data and extract (the pipeline's fingerprints leave the run dir out): hard
      # links to the first arch's outputs and records make the pipeline skip them (~130 s on the H200)
      mkdir -p runs/dsv3-$arch/pipeline && cp -al runs/dsv3-$prev/data runs/dsv3-$prev/features runs/dsv3-$arch/ \
        && cp runs/dsv3-$prev/pipeline/{regenerate,data,extract}.json runs/dsv3-$arch/pipeline/
    fi
    prev=$arch
    # measured on the H200 (2026-12-04), before the demo configs batched regeneration (32 conversations per
    # generate) and chose blockwise TTT attention: target 80 s; regenerate 96 s (one prompt at a time), train 126 s
    # (93 s of it compiling flex attention; 140 s for the mla arch), evaluate > 50 s
    timeout $(budget ${MLA_TIMEOUT:-420}) python3 -m launch.pipeline --config launch/configs/demo-deepseek.yaml \
      --run_dir runs/dsv3-$arch --train.drafter.arch $arch --extract.nproc_per_node 1 --train.nproc_per_node 1 \
      > "$OUT/mla-$arch/pipeline.log" 2>&1
    echo "dsv3 $arch pipeline rc=$?"; grep "^\[pipeline\]" "$OUT/mla-$arch/pipeline.log" | tail -3
    cp runs/dsv3-$arch/report.json "$OUT/mla-$arch/" 2>/dev/null
    [ -f runs/dsv3-$arch/evaluate/evaluate.json ] || { echo "dsv3 $arch: no evaluation, no smoke test"; continue; }
    ( source .sgl/sglang-env.sh; smoke $assets/target runs/dsv3-$arch "$OUT/mla-$arch/smoke" )
  done
fi
