#!/bin/bash
# On the GPU machine (run tool, carry [".whl", ".sgl", the CPU demo's runs/demo/{assets,drafter,train/summary.json,
# evaluate/evaluate.json}]): the demo pipeline on the GPU in runs/gpu (DeepSpeed, one rank, reusing the carried
# demo target) in the background, and the SGLang smoke test of the CPU-trained demo drafter in the foreground.
# Results under $OUT/gpu-demo and $OUT/smoke*.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT/gpu-demo"
source .whl/gpu-env.sh
nvidia-smi --query-gpu=name,memory.used --format=csv
( timeout ${DEMO_TIMEOUT:-560} python3 -m launch.demo --run_dir runs/gpu --extract.nproc_per_node 1 \
    --train.nproc_per_node 1 ${DEMO_ARGS:-} > "$OUT/gpu-demo/demo.log" 2>&1
  echo "rc=$?" >> "$OUT/gpu-demo/demo.log"
  cp runs/gpu/report.json runs/gpu/train/log.jsonl runs/gpu/train/summary.json runs/gpu/evaluate/evaluate.json \
     "$OUT/gpu-demo/" 2>/dev/null ) &
demo=$!
if [ "${SMOKE:-1}" = 1 ]; then
  ( source .sgl/sglang-env.sh
    for dtype in ${SMOKE_DTYPES:-float32}; do
      timeout ${SMOKE_TIMEOUT:-500} python3 -m serve.smoke --target runs/demo/assets/target --drafter runs/demo/drafter \
        --run runs/demo --concurrency 1,8,64 --out "$OUT/smoke-$dtype" --timeout 300 \
        --server-arg=--attention-backend=triton --server-arg=--sampling-backend=pytorch \
        --server-arg=--grammar-backend=none --server-arg=--disable-cuda-graph \
        --server-arg=--mem-fraction-static=0.3 --server-arg=--dtype=$dtype 2>&1 | grep -v "it/s\]$" | tail -60
      echo "smoke $dtype rc=${PIPESTATUS[0]}"
    done )
fi
wait $demo
tail -40 "$OUT/gpu-demo/demo.log"
