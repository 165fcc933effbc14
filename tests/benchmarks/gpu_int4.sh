#!/bin/bash
# The INT4 target on the GPU machine (SGLang 0.5.14): what capturing features from the deployed quantized model
# changes. Built on the CPU first (launch/configs/demo-int4.yaml says how): runs/int4/assets (a DeepseekV3 demo
# target of hidden 128 and its compressed-tensors W4A16 copy), runs/int4/int4-features (a drafter trained on the
# INT4 target's features, its evaluate stage run with both drafters) and runs/int4/bf16-features (the same data,
# the drafter trained on the bf16 original's features). Carry them without features/ and train/ checkpoints:
#   rm -rf runs/gpu-int4; for p in runs/int4/assets runs/int4/{int4,bf16}-features/{data,drafter,evaluate,config}; do
#     mkdir -p runs/gpu-int4/$(dirname $p); cp -al $p runs/gpu-int4/$p; done
#   device command: EYRIE_COMMIT=$(git rev-parse HEAD) bash tests/benchmarks/gpu_int4.sh   (carry .whl .sgl runs/gpu-int4)
# Here, in order, each within what is left of BUDGET (default 570 s):
#   1. SGLang extraction (extract.backend sglang, the engine that serves) of the run's samples from the INT4 target
#      and from the bf16 original, then extract.parity between them: per-layer cosine and max abs difference;
#   2. serve.smoke on the INT4 target: the plain server, the INT4-feature drafter, the bf16-feature drafter, on the
#      run's held-out prompts (one measurements folder: the second drafter reuses the plain server's passes).
# Results under $OUT/int4: parity.log, smoke-int4-features.json, smoke-bf16-features.json, logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
BUDGET=${MISSION_SECONDS:-570}
NAME=int4
source tests/benchmarks/device_env.sh
RESULTS=${OUT:-/tmp/int4-out}/int4
mkdir -p "$RESULTS"
[ -d runs/gpu-int4/runs ] && cp -al runs/gpu-int4/runs . 2>/dev/null
INT4=runs/int4/assets/target-int4 BF16=runs/int4/assets/target
CONFIG=runs/int4/int4-features/config/extract.yaml  # the stage config the pipeline wrote

for variant in int4 bf16; do  # the same samples (the int4 run's data), each target's features
  run=runs/int4/sgl-$variant target=$([ $variant = int4 ] && echo $INT4 || echo $BF16)
  [ -f $run/features/manifest.json ] && continue
  mkdir -p $run && cp -al runs/int4/int4-features/data $run/ 2>/dev/null
  log "extract ($variant target, SGLang)"
  timeout -k 10 "$(within 200)" python3 -m extract --config $CONFIG --run_dir $run --target.path $target \
    --extract.backend sglang --extract.nproc_per_node 1 > "$RESULTS/extract-$variant.log" 2>&1
  log "extract $variant: exit $?"; tail -3 "$RESULTS/extract-$variant.log"
done
python3 -m extract.parity runs/int4/sgl-int4/features runs/int4/sgl-bf16/features > "$RESULTS/parity.log" \
  && cat "$RESULTS/parity.log"  # a table, then the same figures as one JSON line

SERVER_ARGS=(--server-arg=--attention-backend=triton --server-arg=--sampling-backend=pytorch
             --server-arg=--grammar-backend=none --server-arg=--mem-fraction-static=0.5
             --server-arg=--disable-prefill-cuda-graph --server-arg=--dtype=bfloat16)
for features in int4 bf16; do  # both drafters on the INT4 target, against the same plain server
  log "smoke: drafter trained on $features features, served on the INT4 target"
  timeout -k 20 "$(within 15)" python3 -m serve.smoke --target $INT4 --drafter runs/int4/$features-features/drafter \
    --run runs/int4/int4-features --concurrency 1,8 --out runs/int4/smoke "${SERVER_ARGS[@]}" \
    > "$RESULTS/smoke-$features-features.log" 2>&1
  log "smoke $features: exit $?"; grep -v "^waiting for" "$RESULTS/smoke-$features-features.log" | tail -25
  cp runs/int4/smoke/report.json "$RESULTS/smoke-$features-features.json" 2>/dev/null
done
tar -czf "$RESULTS/servers.tar.gz" runs/int4/smoke 2>/dev/null
log "done"
