#!/usr/bin/env bash
# Assemble the folder that benchmarks/gpu_session.sh takes to a GPU machine (GPU_BUNDLE, default .gpu):
#   whl/    wheels the GPU image lacks, for its Python 3.12: datasets (and dill, multiprocess, a pyarrow
#           new enough for it) and TRL 1.16, the baseline of the GRPO rows
#   bench/  ../shared/bench's common.py, run_grpo.py, run_rloo_grpo.py and posttrain_shim/
# The folder is kept out of git (.git/info/exclude) and travels with the device call's `carry`.
#
#   bash benchmarks/gpu_bundle.sh [DEST] [BENCH_DIR]      # defaults: .gpu ../shared/bench
set -euo pipefail
DEST=${1:-.gpu}
BENCH=${2:-../shared/bench}
PY=${PY:-python3}
mkdir -p "$DEST/whl" "$DEST/bench"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST/whl" datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pyarrow==26.0.1 trl==1.16.0
cp "$BENCH/common.py" "$BENCH/run_grpo.py" "$BENCH/run_rloo_grpo.py" "$DEST/bench/"
rm -rf "$DEST/bench/posttrain_shim"
cp -r "$BENCH/posttrain_shim" "$DEST/bench/"
find "$DEST/bench" -name __pycache__ -prune -exec rm -rf {} +
if [ -d .git ] && ! grep -qx "/$(basename "$DEST")/" .git/info/exclude 2>/dev/null; then
  echo "/$(basename "$DEST")/" >> .git/info/exclude
fi
du -sh "$DEST"
