#!/bin/bash
# The mission run at 8B cost (launch/configs/mission-8b.yaml) on the GPU machine, as consecutive device commands
# on one machine (10 minutes each); every command runs this same script and resumes from what the warm machine
# holds: the mission's 100M target (launch/mission_target.py, trained here: no hub), its own answers to the prompts
# (the mission config's regenerate stage, for the comparison), the target widened to Llama-3.1-8B's shape
# (launch/widen_target.py), the 8B-cost pipeline (regenerate through SGLang, SGLang extraction at hidden 4096 with
# fp8 aux states, DeepSpeed training, export, evaluation), the widened target's answers compared with the small
# one's (answers.json: must be equal on >= 99% of prompts), and `serve.smoke --sweep` (every chain 1-7 and the
# default trees at concurrency 1/8/32/64; each server's measurements are kept, so a cut-off sweep resumes at the
# next server). Stage times are in the pipeline's reports.
#
#   device command (repeat until it says done):  EYRIE_COMMIT=$(git rev-parse HEAD) bash tests/benchmarks/mission_8b.sh
#   (carry .whl, .sgl); env: MISSION_SECONDS (this command's budget, default 570)
set -uo pipefail
cd "$(dirname "$0")/../.."
BUDGET=${MISSION_SECONDS:-570}
NAME=mission-8b
source tests/benchmarks/device_env.sh
SMALL=runs/mission
RUN=runs/mission-8b
OUT_DIR=${OUT:-/tmp/mission-8b-out}/mission-8b
SERVER_ARGS=(--server-arg=--attention-backend=triton --server-arg=--sampling-backend=pytorch
             --server-arg=--grammar-backend=none --server-arg=--mem-fraction-static=0.6
             --server-arg=--disable-prefill-cuda-graph)
collect() {  # the reports as they are, the rest in one archive (at most 8 files come back)
  mkdir -p "$OUT_DIR"
  cp -f $RUN/report.json $RUN/evaluate/evaluate.json $RUN/answers.json "$OUT_DIR/" 2>/dev/null
  cp -f $RUN/sweep/report.json "$OUT_DIR/sweep-report.json" 2>/dev/null
  tar -czf "$OUT_DIR/results.tar.gz" --ignore-failed-read $RUN/pipeline $RUN/evaluate $RUN/sweep/*.json \
    $RUN/sweep/*.log $RUN/data/*.report.json $RUN/data/split.json $RUN/train/summary.json $RUN/drafter/README.md \
    $RUN/drafter/config.json $RUN/target/widen.json $RUN/target/config.json 2>/dev/null
  du -sh $RUN/features $RUN/target 2>/dev/null; df -h . | tail -1
  log "results in $OUT_DIR"
}
trap collect EXIT

if [ ! -f $SMALL/assets/target/training.json ]; then
  TORCHINDUCTOR_CACHE_DIR=/tmp/target-jit/inductor TRITON_CACHE_DIR=/tmp/target-jit/triton \
    step "the 100M target: training (resumes from its last save)" \
    python3 -m launch.mission_target --out $SMALL/assets --minutes 7
  [ -f $SMALL/assets/target/training.json ] || { log "target: not finished; run this script again"; exit 0; }
fi
step "the 100M target's answers" python3 -m launch.pipeline --config launch/configs/mission.yaml --stages regenerate
[ -f $RUN/target/widen.json ] || step "widening to Llama-3.1-8B's shape" \
  python3 -m launch.widen_target --source $SMALL/assets/target --out $RUN/target --shape llama3-8b
step "pipeline at 8B cost" python3 -m launch.pipeline --config launch/configs/mission-8b.yaml \
  --stages regenerate,data,extract,train,export,evaluate
python3 tests/benchmarks/compare_answers.py $SMALL/data/regenerated.jsonl $RUN/data/regenerated.jsonl \
  > $RUN/answers.json && log "answers: $(head -c 300 $RUN/answers.json)"
if [ "$(left)" -lt 200 ]; then log "sweep: $(left) s left, too few to start a server; run this script again"; exit 0; fi
step "serve.smoke --sweep" python3 -m serve.smoke --target $RUN/target --drafter $RUN/drafter --run $RUN \
  --concurrency 1,8,32,64 --sweep --out $RUN/sweep "${SERVER_ARGS[@]}"
log "done"
