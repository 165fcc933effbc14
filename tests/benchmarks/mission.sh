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
#   env: MISSION_SECONDS (this command's budget, default 570), TARGET_MINUTES (default 7), MISSION_PROMPTS (the
#   drafter's data: distinct prompts the target answers, default 12000; fewer shorten every stage), EYRIE_COMMIT (the
#   commit the tree is, recorded in the reports: the machine's copy has no .git), MISSION_ARGS (config overrides
#   for every pipeline call, e.g. "--train.epochs 8 --serve.concurrency [1,8]"), GPU_TESTS=0 (skip them), DFLASH=1
#   (a DFlash drafter too: runs/mission-dflash shares the run's data and features, trains, exports and evaluates
#   its drafter, and is served beside the EAGLE-3 drafter against the same plain server's measurements),
#   MISSION_STAGES (the pipeline's stages, default regenerate,...,evaluate; given, nothing is served),
#   OPTIONS (EAGLE-3 drafters trained with and without options on the run's data and features, three seeds each,
#   scored by their training evaluation: compare_options.py --stages data,extract,train; variants NAME=OVERRIDES
#   separated by ';', beside `plain=`; its record OPTIONS_RECORD, default eagle31-mission-DATE, comes back in
#   results.tar.gz; nothing is served after it, since the run's drafter is then the last variant's), e.g.
#   MISSION_STAGES=regenerate,data,extract OPTIONS="fc_norm=--train.drafter.fc_norm=true"
# The command that reaches the smoke stage first runs the GPU tests (pytest -m gpu, log gpu-tests.log).
# Then, here: python tests/benchmarks/record_mission.py FILES_AT/mission  (writes tests/benchmarks/results/), and
# with DFLASH=1 both drafters served: record_smoke.py FILES_AT/mission/smoke-report.json
# FILES_AT/mission/dflash-smoke-report.json --label EAGLE-3 --label DFlash ... (one plain server's passes).
# The trained target (7 device-minutes) can be kept for later machines: `bash tests/benchmarks/parts.sh out
# mission-assets FIRST runs/mission/assets target conversations.jsonl prompts.json` (parts.sh says how); carried
# back as .parts/mission-assets-*, it is unpacked here instead of trained again.
set -uo pipefail
cd "$(dirname "$0")/../.."
BUDGET=${MISSION_SECONDS:-570}
NAME=mission
source tests/benchmarks/device_env.sh
RUN=runs/mission
DFLASH_RUN=runs/mission-dflash
ASSETS=$RUN/assets
OUT_DIR=${OUT:-/tmp/mission-out}/mission
collect() {  # at most 8 files come back from $OUT: the reports as they are, the rest in one archive
  mkdir -p "$OUT_DIR"
  cp -f $RUN/report.json $RUN/evaluate/evaluate.json "$OUT_DIR/" 2>/dev/null
  cp -f $RUN/smoke/report.json "$OUT_DIR/smoke-report.json" 2>/dev/null
  cp -f $RUN/drafter/config.json "$OUT_DIR/drafter-config.json" 2>/dev/null
  cp -f $DFLASH_RUN/smoke/report.json "$OUT_DIR/dflash-smoke-report.json" 2>/dev/null
  tar -czf "$OUT_DIR/results.tar.gz" --ignore-failed-read $RUN/pipeline $RUN/evaluate $RUN/tensorboard \
    $RUN/smoke/*.log $RUN/smoke/*.json $RUN/data/*.report.json $RUN/data/split.json $RUN/data/samples/manifest.json \
    $RUN/train/summary.json $RUN/drafter/README.md $ASSETS/prompts.json $ASSETS/target/training*.json \
    $ASSETS/target/config.json /tmp/gpu-tests.log $DFLASH_RUN/report.json $DFLASH_RUN/evaluate \
    $DFLASH_RUN/pipeline $DFLASH_RUN/smoke/*.log $DFLASH_RUN/smoke/*.json $DFLASH_RUN/drafter/config.json \
    $RUN/options tests/benchmarks/results/"${OPTIONS_RECORD:-}".json 2>/dev/null
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

# a target trained on an earlier machine, brought back and carried in parts, instead of training one here
if [ ! -f $ASSETS/target/training.json ] && compgen -G ".parts/*/mission-assets.sha256" >/dev/null; then
  bash tests/benchmarks/parts.sh in mission-assets $ASSETS || { log "target: carry its other parts first"; exit 0; }
fi
if [ ! -f $ASSETS/target/training.json ]; then
  log "target: training (resumes from its last save)"
  # its compiled step's kernels stay out of the caches that come back: the Inductor archive is dropped whole
  # past 16 MB, and the drafter's compiles (~100 s) matter more than the target's
  TORCHINDUCTOR_CACHE_DIR=/tmp/target-jit/inductor TRITON_CACHE_DIR=/tmp/target-jit/triton \
  timeout -k 20 -s INT "$(within 30)" python3 -m launch.mission_target --out $ASSETS --minutes "${TARGET_MINUTES:-7}" \
    --prompts "${MISSION_PROMPTS:-12000}" \
    || log "target: stopped (exit $?)"
  [ -f $ASSETS/target/training.json ] || { log "target: not finished; run this script again"; exit 0; }
fi

STAGES=${MISSION_STAGES:-regenerate,data,extract,train,export,evaluate}
read -ra OVERRIDES <<< "${MISSION_ARGS:-}"  # split on spaces, never globbed ("[1,8]" is a value, not a pattern)
[ -z "${OPTIONS:-}" ] || OPTIONS_RECORD=${OPTIONS_RECORD:-eagle31-mission-$(date +%F)}
PIPELINE=(python3 -m launch.pipeline --config launch/configs/mission.yaml "${OVERRIDES[@]}")
step "pipeline $RUN: $STAGES" "${PIPELINE[@]}" --run_dir $RUN --stages $STAGES
if [ -n "${DFLASH:-}" ]; then  # a DFlash drafter on the same data and features: its run shares the EAGLE-3 run's
  [ -d $DFLASH_RUN ] || { mkdir -p $DFLASH_RUN && for d in data features pipeline config; do  # finished stages
    cp -al $RUN/$d $DFLASH_RUN/; done; }                    # (the pipeline skips them: same inputs, same fingerprints)
  step "pipeline $DFLASH_RUN: $STAGES" "${PIPELINE[@]}" --run_dir $DFLASH_RUN --stages $STAGES \
    --train.drafter.family dflash
fi

if [ -n "${OPTIONS:-}" ]; then  # each (variant, seed) kept as it finishes: a rerun resumes at the next one
  IFS=';' read -ra VARIANTS <<< "$OPTIONS"
  step "options: plain; $OPTIONS" python3 tests/benchmarks/compare_options.py --config launch/configs/mission.yaml \
    --run-dir $RUN --stages data,extract,train --variant plain= "${VARIANTS[@]/#/--variant=}" --seeds 0,1,2 \
    --record "$OPTIONS_RECORD" -- "${OVERRIDES[@]}"
fi
if [ -n "${MISSION_STAGES:-}${OPTIONS:-}" ]; then log "done: nothing is served (MISSION_STAGES or OPTIONS)"; exit 0; fi
# the smoke test starts a server per configuration; a rerun skips those already measured: room for one
if [ "$(left)" -lt 150 ]; then
  log "smoke: $(left) s left, too few to start a server; run this script again"; exit 0
fi
if [ ! -f /tmp/gpu-tests.log ] && [ "${GPU_TESTS:-1}" = 1 ]; then  # once per machine: the GPU tests at this tree
  log "GPU tests"                                                   # (flex, SGLang extraction, serving)
  timeout -k 10 "$(within 360)" python3 -m pytest -q -rfs -p no:cacheprovider -m gpu tests 2>&1 \
    | tee /tmp/gpu-tests.log | tail -5
  if [ "$(left)" -lt 200 ]; then log "smoke: $(left) s left after the GPU tests; run this script again"; exit 0; fi
fi
REACHED_SMOKE=1
RESERVE=15 step "pipeline $RUN: smoke" "${PIPELINE[@]}" --run_dir $RUN --stages smoke
if [ -n "${DFLASH:-}" ]; then  # beside the same plain server: its measurements are reused (serve.smoke keys them)
  mkdir -p $DFLASH_RUN/smoke && cp -n $RUN/smoke/server-baseline.json $DFLASH_RUN/smoke/
  RESERVE=15 step "pipeline $DFLASH_RUN: smoke" "${PIPELINE[@]}" --run_dir $DFLASH_RUN --stages smoke \
    --train.drafter.family dflash
fi
