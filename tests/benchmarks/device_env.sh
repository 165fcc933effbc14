# Sourced by the GPU-machine scripts (mission.sh, mission_8b.sh): the environment (DeepSpeed and SGLang from the
# carried .whl/ and .sgl/, Inductor's cache restored), the time budget helpers, and what a previous command cut off
# mid-stage left running. Expects BUDGET (seconds this command may run) and NAME (the log prefix).
source .whl/gpu-env.sh
source .sgl/sglang-env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
export TORCHINDUCTOR_CACHE_DIR=/tmp/sgl-jit/inductor  # beside SGLang's JIT caches (Triton's binaries: ../triton)
# Inductor's compiled drafter graphs from an earlier run (collect brings them back as inductor.tar.xz, to be
# copied to .sgl/): the training and evaluation compiles (~100 s of the train stage on a fresh machine) hit them
if [ -f .sgl/inductor.tar.xz ] && [ ! -f /tmp/sgl-jit/inductor/.restored ]; then
  mkdir -p /tmp/sgl-jit && tar -C /tmp/sgl-jit -xJf .sgl/inductor.tar.xz && touch /tmp/sgl-jit/inductor/.restored
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The kernels this machine built, as DIR/NAME.tar.xz of /tmp/sgl-jit (TAR-ARGS pick what): jitcache.tar.xz (Triton
# and TVM-FFI binaries; sglang-env.sh unpacks it) and inductor.tar.xz (Inductor's graphs; unpacked above), copied
# to .sgl/ they spare a later fresh machine the builds. Whole and within what comes back (16 MB a file), or not at all
pack_jit() {  # DIR NAME TAR-ARGS
  local dir=$1 name=$2; shift 2
  tar -C /tmp/sgl-jit -cf - "$@" 2>/dev/null | timeout 60 xz -T0 -3 >/tmp/$name.tar.xz \
    && [ "$(stat -c %s /tmp/$name.tar.xz)" -lt 16000000 ] && mv /tmp/$name.tar.xz "$dir/"
}
left() { echo $((BUDGET - SECONDS)); }
within() { local s=$(($(left) - $1)); echo $((s > 1 ? s : 1)); }  # a timeout that keeps $1 s in hand (0 would mean none)
log() { echo "[$NAME $(date +%T) +${SECONDS}s] $*"; }
step() {  # NAME COMMAND...: a resumable step within the budget (RESERVE s kept in hand, default 30); if it did not
  local name=$1; shift  # finish, this command stops, for the next one to resume
  log "$name"
  timeout -k 20 -s INT "$(within "${RESERVE:-30}")" "$@" || { log "$name: stopped (exit $?); run this script again"
    # training checkpoints the step the SIGINT stopped it at; its ranks outlive the launchers for that save
    for _ in $(seq 20); do pgrep -f "train/main.py" >/dev/null || break; sleep 1; done; exit 0; }
}

# a previous command cut off mid-stage may have left servers or ranks behind
pkill -f sglang.launch_server; pkill -f "train/main.py"; pkill -f "torch.distributed.run"
pkill -f -- "-m extract --config"; pkill -f -- "-m data.regenerate"; sleep 1  # torchrun's orphaned workers
nvidia-smi --query-gpu=memory.used --format=csv,noheader
