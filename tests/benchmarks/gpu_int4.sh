#!/bin/bash
# The INT4 target on the GPU machine (SGLang 0.5.14): what capturing features from the deployed quantized model
# changes. Built on the CPU first (launch/configs/demo-int4.yaml says how): runs/int4/assets (a DeepseekV3 demo
# target of hidden 128 and its compressed-tensors W4A16 copy), runs/int4/int4-features (a drafter trained on the
# INT4 target's features, its evaluate stage run with both drafters) and runs/int4/bf16-features (the same data,
# the drafter trained on the bf16 original's features). Carry them without features/ and train/ checkpoints:
#   rm -rf runs/gpu-int4; for p in runs/int4/assets runs/int4/{int4,bf16}-features/{data,drafter,evaluate,config}; do
#     mkdir -p runs/gpu-int4/$(dirname $p); cp -al $p runs/gpu-int4/$p; done
#   device command (carry .whl, .sgl, runs/gpu-int4):
#     EYRIE_COMMIT=$(git rev-parse HEAD) bash tests/benchmarks/gpu_int4.sh
# Here, each within what is left of BUDGET (default 570 s):
#   - SGLang's Marlin MoE kernel built on its own, detached (a fresh machine only; about 400 s on an H100), while
#     SGLang extracts (extract.backend sglang, the engine that serves) the run's samples from the bf16 original;
#   - the same from the INT4 target, then extract.parity between them: per-layer cosine and max abs difference;
#   - serve.smoke on the INT4 target at CONCURRENCY (default 1,8): the plain server, the INT4-feature drafter, the
#     bf16-feature drafter, on the run's held-out prompts (one measurements folder: the second drafter reuses the
#     plain server's passes). A drafter not carried is not served: carrying runs/int4/assets and the two runs'
#     data/ and config/ alone measures the features' parity.
# Results under $OUT/int4: parity.log, smoke-int4-features.json, smoke-bf16-features.json, jitcache.tar.xz and
# logs.tar.gz (logs, the shards' manifests, the servers' measurements and logs).
# Every step resumes from what the warm machine holds: run the command again until it logs "done". Then, here:
#   python tests/benchmarks/record_smoke.py INT4/smoke-int4-features.json INT4/smoke-bf16-features.json \
#     --label "trained on INT4 features" --label "trained on bf16 features" --feature-parity INT4/parity.log \
#     --name served-int4-DATE --date DATE --command "..."   (INT4: the files_at folder's int4/; then render_results.py)
#   or, the parity alone (served-int4-demo-2026-12-07.json has the drafters served; carry runs/int4/assets and the two
#   runs' data/ and config/ only: about 64 MB with .whl and .sgl, no room for the returned 8.5-MB jitcache.tar.xz):
#   python tests/benchmarks/record_smoke.py --into tests/benchmarks/results/served-int4-demo-2026-12-07.json \
#     --feature-parity INT4/parity.log --command "..."
set -uo pipefail
cd "$(dirname "$0")/../.."
BUDGET=${MISSION_SECONDS:-570}
NAME=int4
source tests/benchmarks/device_env.sh
RESULTS=${OUT:-/tmp/int4-out}/int4
# the logs, the shards' manifests and the servers' files come back as one logs.tar.gz: at most 8 files come back
# from $OUT, so only the results and the kernel archive are files of their own
LOGS=/tmp/int4-logs
mkdir -p "$RESULTS" $LOGS
trap 'tar -czf "$RESULTS/logs.tar.gz" --ignore-failed-read $LOGS runs/int4/smoke 2>/dev/null' EXIT
[ -d runs/gpu-int4/runs ] && cp -al runs/gpu-int4/runs . 2>/dev/null
INT4=runs/int4/assets/target-int4 BF16=runs/int4/assets/target
CONFIG=runs/int4/int4-features/config/extract.yaml  # the stage config the pipeline wrote
carried() { [ -d runs/int4/$1-features/drafter ]; }  # FEATURES: the drafter trained on them came to be served

extract() {  # VARIANT TARGET: SGLang's features of VARIANT's samples (the same conversations, each tokenized
  local run=runs/int4/sgl-$1  # for its own target: extraction checks the samples name the target it runs)
  [ -f $run/features/manifest.json ] && return
  mkdir -p $run && cp -al runs/int4/$1-features/data $run/ 2>/dev/null
  log "extract ($1 target, SGLang)"
  local reserve=0  # seconds kept in hand for serving, when a drafter is carried to serve
  { carried int4 || carried bf16; } && reserve=200
  timeout -k 10 "$(within $reserve)" python3 -m extract --config $CONFIG --run_dir $run --target.path $2 \
    --extract.backend sglang --extract.nproc_per_node 1 > $LOGS/extract-$1.log 2>&1
  log "extract $1: exit $?"; tail -3 $LOGS/extract-$1.log
  cp $run/features/manifest.json $LOGS/features-$1-manifest.json 2>/dev/null  # what the shards record
}
SERVER_ARGS=(--server-arg=--attention-backend=triton --server-arg=--sampling-backend=pytorch
             --server-arg=--grammar-backend=none --server-arg=--mem-fraction-static=0.5
             --server-arg=--disable-prefill-cuda-graph --server-arg=--dtype=bfloat16)
smoke() {  # FEATURES: the drafter trained on FEATURES' features, served on the INT4 target
  local report=runs/int4/smoke-$1-features.json  # kept on the machine: a later command copies it, not reruns it
  carried $1 || { log "smoke $1: its drafter is not carried, skipped"; return; }
  [ -f $report ] || {
    log "smoke: drafter trained on $1 features, served on the INT4 target"
    timeout -k 20 "$(within 15)" python3 -m serve.smoke --target $INT4 --drafter runs/int4/$1-features/drafter \
      --run runs/int4/int4-features --concurrency "${CONCURRENCY:-1,8}" --out runs/int4/smoke "${SERVER_ARGS[@]}" \
      > $LOGS/smoke-$1-features.log 2>&1
    local status=$?
    log "smoke $1: exit $status"; grep -v "^waiting for" $LOGS/smoke-$1-features.log | tail -25
    # report.json is shared by both drafters' runs (one --out): only a finished run's is this drafter's
    [ $status = 0 ] && cp runs/int4/smoke/report.json $report; }
  cp $report "$RESULTS/" 2>/dev/null
}
MARLIN_TAG="eyrie: build the Marlin MoE kernel"
marlin_built() { compgen -G "/tmp/sgl-jit/tvm-ffi/sgl_kernel_jit_moe_wna16_marlin_bf16_*/*.so" >/dev/null; }
start_marlin_build() {  # SGLang's INT4 MoE kernel, built alone and whole before anything needs it
  # One nvcc translation unit of every Marlin template instance: 400 s on a fresh H100, inside the first forward
  # (extraction's prefill, the server's CUDA-graph capture) unless built before. Stopped by a stage's time limit it
  # starts over in the next process, so here it runs detached (SGLang 0.5.14's builder, called as its MoE layer calls
  # it): a build this command's budget does not hold goes on, and the next command waits for it. It needs no GPU:
  # the bf16 target's extraction runs meanwhile.
  if marlin_built || pgrep -f "$MARLIN_TAG" >/dev/null; then return; fi
  log "build SGLang's Marlin MoE kernel (bf16), detached"; date +%s > /tmp/build-marlin.started
  setsid nohup python3 -c "# $MARLIN_TAG
import torch
from sglang.jit_kernel.moe_wna16_marlin import _jit_moe_wna16_marlin_module as build
build(torch.bfloat16)" > /tmp/build-marlin.log 2>&1 < /dev/null &
}
wait_marlin_build() {
  marlin_built && return
  while pgrep -f "$MARLIN_TAG" >/dev/null && [ "$(left)" -gt 30 ]; do sleep 5; done
  cp /tmp/build-marlin.log $LOGS/
  if ! marlin_built; then
    local running; pgrep -f "$MARLIN_TAG" >/dev/null && running=", still running"
    log "Marlin build not finished${running:-}: run this command again"
    tail -5 /tmp/build-marlin.log; exit 0
  fi
  log "Marlin kernel built in $(( $(date +%s) - $(cat /tmp/build-marlin.started) )) s"
  # $OUT/int4/jitcache.tar.xz (8.5 MB) spares a fresh machine the build, where the carry has room for it: .sgl/ with
  # it, .whl and every path of runs/gpu-int4 come to about 72 MB, over the 64 MiB a call carries
  pack_jit "$RESULTS" jitcache --exclude=./inductor .
}
# the bf16 target while the kernel builds; then, most telling first, should the budget end early: SGLang runs the
# INT4 target at all, then the accept lengths, then the features' parity
start_marlin_build
extract bf16 $BF16
wait_marlin_build
extract int4 $INT4
smoke int4
smoke bf16  # against the same plain server: its measurements are reused
finished() {  # parity, and a smoke report for each carried drafter
  for f in int4 bf16; do carried $f && [ ! -f runs/int4/smoke-$f-features.json ] && return 1
  done; return 0
}
if python3 -m extract.parity runs/int4/sgl-int4/features runs/int4/sgl-bf16/features > "$RESULTS/parity.log" \
   2> $LOGS/parity.err && finished; then
  cat "$RESULTS/parity.log"; log "done"  # a table, then the same figures as one JSON line (record_smoke reads it)
else
  log "not finished: run this command again (the warm machine keeps every finished step)"
fi
