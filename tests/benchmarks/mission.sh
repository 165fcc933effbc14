#!/bin/bash
# The mission-scale run (launch/configs/mission.yaml) on the GPU machine, as up to three consecutive device
# commands on one machine (10 minutes each). Every command runs this same script: it resumes from what the warm
# machine holds (launch/mission_target.py's checkpoints, the pipeline's stage skipping, DeepSpeed's `latest` at
# the step the time limit's SIGINT stopped training, extraction's sealed shards, regeneration's output file),
# stops cleanly before its time is up, and copies the small results (reports, TensorBoard events, the drafter's
# config, logs; at most 8 files come back) to $OUT/mission, and once the smoke stage has run the machine's JIT
# kernel caches (jitcache.tar.xz and inductor.tar.xz: copy them to .sgl/ for the next fresh machine; .whl + .sgl
# must stay under the 64 MiB a call carries).
#
#   device command (x3):  EYRIE_COMMIT=$(git rev-parse HEAD) bash tests/benchmarks/mission.sh   (carry .whl, .sgl)
#   env: MISSION_SECONDS (this command's budget, default 570), TARGET_MINUTES (default 7), EYRIE_COMMIT (the
#   commit the tree is, recorded in the reports: the machine's copy has no .git)
# The command that reaches the smoke stage first runs the GPU tests (pytest -m gpu, log gpu-tests.log).
# Then, here: python tests/benchmarks/record_mission.py FILES_AT/mission  (writes tests/benchmarks/results/)
set -uo pipefail
cd "$(dirname "$0")/../.."
BUDGET=${MISSION_SECONDS:-570}
NAME=mission
source tests/benchmarks/device_env.sh
RUN=runs/mission
ASSETS=$RUN/assets
OUT_DIR=${OUT:-/tmp/mission-out}/mission
collect() {  # at most 8 files come back from $OUT: the reports as they are, the rest in one archive
  mkdir -p "$OUT_DIR"
  cp -f $RUN/report.json $RUN/evaluate/evaluate.json "$OUT_DIR/" 2>/dev/null
  cp -f $RUN/smoke/report.json "$OUT_DIR/smoke-report.json" 2>/dev/null
  cp -f $RUN/drafter/config.json "$OUT_DIR/drafter-config.json" 2>/dev/null
  tar -czf "$OUT_DIR/results.tar.gz" --ignore-failed-read $RUN/pipeline $RUN/evaluate $RUN/tensorboard \
    $RUN/smoke/*.log $RUN/smoke/*.json $RUN/data/*.report.json $RUN/data/split.json $RUN/data/samples/manifest.json \
    $RUN/train/summary.json $RUN/drafter/README.md $ASSETS/prompts.json $ASSETS/target/training*.json \
    $ASSETS/target/config.json /tmp/gpu-tests.log 2>/dev/null
  # the kernels this machine built (device_env.sh's pack_jit), in two archives, so that a large Inductor cache
  # cannot keep SGLang's from coming back; only by the command that reaches the smoke stage: the others return a
  # few kilobytes, so that the next command finds the machine still warm (it is given back 30 s after a command;
  # 14 MB of caches took longer once)
  if [ -d /tmp/sgl-jit ] && [ -n "${REACHED_SMOKE:-}" ]; then
    pack_jit "$OUT_DIR" jitcache --exclude=./inductor .; pack_jit "$OUT_DIR" inductor ./inductor
  fi
  du -sh $RUN/features /tmp/sgl-jit 2>/dev/null; df -h . | tail -1
  log "results in $OUT_DIR"
}
trap collect EXIT

if [ ! -f $ASSETS/target/training.json ]; then
  log "target: training (resumes from its last save)"
  # its compiled step's kernels stay out of the caches that come back: the Inductor archive is dropped whole
  # past 16 MB, and the drafter's compiles (~100 s) matter more than the target's
  TORCHINDUCTOR_CACHE_DIR=/tmp/target-jit/inductor TRITON_CACHE_DIR=/tmp/target-jit/triton \
  timeout -k 20 -s INT "$(within 30)" python3 -m launch.mission_target --out $ASSETS --minutes "${TARGET_MINUTES:-7}" \
    || log "target: stopped (exit $?)"
  [ -f $ASSETS/target/training.json ] || { log "target: not finished; run this script again"; exit 0; }
fi

STAGES=regenerate,data,extract,train,export,evaluate
log "pipeline: $STAGES"
timeout -k 20 -s INT "$(within 30)" python3 -m launch.pipeline --config launch/configs/mission.yaml --stages $STAGES \
  || { log "pipeline: stopped (exit $?); run this script again to resume"
       # training checkpoints the step the SIGINT stopped it at; its ranks outlive the launchers for that save
       for _ in $(seq 20); do pgrep -f "train/main.py" >/dev/null || break; sleep 1; done; exit 0; }

# the smoke test starts a server per configuration; a rerun skips those already measured: room for one
if [ "$(left)" -lt 150 ]; then
  log "smoke: $(left) s left, too few to start a server; run this script again"; exit 0
fi
if [ ! -f /tmp/gpu-tests.log ]; then  # once per machine: the GPU tests at this tree (flex, SGLang extraction, serving)
  log "GPU tests"
  timeout -k 10 "$(within 360)" python3 -m pytest -q -rfs -p no:cacheprovider -m gpu tests 2>&1 | tee /tmp/gpu-tests.log \
    | tail -5
  if [ "$(left)" -lt 200 ]; then log "smoke: $(left) s left after the GPU tests; run this script again"; exit 0; fi
fi
log "pipeline: smoke"
REACHED_SMOKE=1
timeout -k 20 -s INT "$(within 15)" python3 -m launch.pipeline --config launch/configs/mission.yaml --stages smoke \
  || log "smoke: stopped (exit $?)"
