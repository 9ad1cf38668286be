#!/usr/bin/env bash
# Everything one GPU lease is for, in one call, most important first, inside a deadline:
#   1. the GPU tests (pytest -m gpu): every decode engine's rollout contract on CUDA, bf16 training steps;
#   2. the 0.5B-shaped artifacts (benchmarks/build_05b.py, random weights, offline);
#   3. ../shared/bench's run_grpo.py (then run_rloo_grpo.py) on TRL and on posttrain, back to back, bf16,
#      with each library's default decode and with cache_implementation="static"
#      (benchmarks/gpu_trl_runner.py: the bench scripts unchanged but for use_cpu).
#
#   GPU_BUNDLE=DIR bash benchmarks/gpu_session.sh [DEADLINE_S]
#
# GPU_BUNDLE (default .gpu): whl/ (wheels missing on the GPU image: datasets, dill, multiprocess, pyarrow,
# trl 1.16) and bench/ (common.py, run_grpo.py, run_rloo_grpo.py, posttrain_shim/ from ../shared/bench).
# PLAN: the runs of step 3 instead of the default list, as LIBRARY:SCRIPT:CACHE_IMPL words.
# Results: $OUT/results.jsonl (one RESULT line per run), $OUT/session.log, $OUT/tests.log.
# Bench knobs default to SIZE=05b BF16=1 EPISODES=256 (16 steps of BATCH=16, K=2, RESP_LEN=53). A dry run on
# a CPU machine: BUILD_ARGS="--layers 1 --hidden 56 --intermediate 128" EPISODES=32 (TRL runs need trl importable).
set -uo pipefail
DEADLINE=${1:-540}
OUT=${OUT:-outputs/gpu_session}
B=${GPU_BUNDLE:-.gpu}
mkdir -p "$OUT"
log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$OUT/session.log"; }
left() { echo $((DEADLINE - SECONDS)); }

if [ -d "$B/whl" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/pt/site-packages "$B"/whl/*.whl \
    || { log "wheel install failed"; exit 1; }
  # a path with "site-packages" in it: dill pickles modules found elsewhere by value, which breaks the
  # fingerprints datasets computes (PicklingError on pyarrow types)
  export PYTHONPATH=/tmp/pt/site-packages
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false PYTHONHASHSEED=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/session.log"
python3 -c "import torch, transformers, accelerate, datasets, trl; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'accelerate', accelerate.__version__, 'datasets', datasets.__version__, 'trl', trl.__version__)" \
  2>&1 | tee -a "$OUT/session.log"

log "1. GPU tests"
timeout $(( $(left) < 200 ? $(left) : 200 )) python3 -m pytest -p no:cacheprovider -m gpu -rs tests/test_gpu.py \
  tests/test_gpu_engines.py > "$OUT/tests.log" 2>&1
log "tests rc=$? $(tail -n 1 "$OUT/tests.log")"

export ART=/tmp/art SIZE=${SIZE:-05b} BF16=${BF16:-1} EPISODES=${EPISODES:-256} RUNS=/tmp/runs
log "2. artifacts"
timeout 200 python3 benchmarks/build_05b.py "$ART" ${BUILD_ARGS:-} > "$OUT/build.log" 2>&1 || { log "build failed: $(tail -n 3 "$OUT/build.log")"; exit 1; }
log "built"

run() {  # run LIBRARY SCRIPT CACHE_IMPL
  local need=${NEED:-100}
  if [ "$(left)" -lt "$need" ]; then log "skip $1 $2 ${3:-default}: $(left) s left"; return; fi
  CACHE_IMPL=$3 timeout "$(left)" python3 benchmarks/gpu_trl_runner.py "$1" "$B/bench" "$2" > /tmp/run.log 2>&1
  local rc=$?
  grep '^RESULT ' /tmp/run.log | sed 's/^RESULT //' >> "$OUT/results.jsonl"
  log "$1 $2 ${3:-default} rc=$rc $(grep '^RESULT ' /tmp/run.log | sed 's/^RESULT //' | python3 -c \
'import json,sys; [print(r["eps_wall"], "eps/s", r["cuda_peak_gib"], "GiB", r["ru_maxrss_mb"], "MB RSS") for r in map(json.loads, sys.stdin)]' 2>/dev/null)"
  [ $rc -eq 0 ] || { tail -n 25 /tmp/run.log >> "$OUT/session.log"; }
}
log "3. TRL vs posttrain, $SIZE, bf16=$BF16, $EPISODES episodes"
if [ -n "${PLAN:-}" ]; then  # e.g. PLAN="posttrain:run_grpo.py:static trl:run_grpo.py:"
  for entry in $PLAN; do IFS=: read -r lib script impl <<< "$entry"; run "$lib" "$script" "$impl"; done
else
  run trl run_grpo.py ""
  run posttrain run_grpo.py ""
  run posttrain run_grpo.py static
  run trl run_grpo.py static
  run trl run_rloo_grpo.py ""
  run posttrain run_rloo_grpo.py ""
  log "4. GRPO with 64 completions per step"
  export BATCH=64 EPISODES=1024
  NEED=120 run trl run_grpo.py ""
  NEED=120 run posttrain run_grpo.py ""
  NEED=120 run posttrain run_grpo.py static
fi
log "done"
