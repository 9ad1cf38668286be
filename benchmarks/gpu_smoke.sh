#!/usr/bin/env bash
# One-GPU smoke benchmark: PPO and GRPO, bf16, on the 0.5B-shaped model (benchmarks/gpu_smoke.py).
#
#   bash benchmarks/gpu_smoke.sh                      # builds the 0.5B shape in memory, random weights
#   MODEL_DIR=/path/to/model bash benchmarks/gpu_smoke.sh --steps 5
#   bash benchmarks/gpu_smoke.sh --dry-run            # tiny model; also runs on a CPU-only machine
#
# Extra arguments go to gpu_smoke.py (--algos, --steps, --batch_size, --response_length, --hbm_gbps,
# --peak_tflops, ...). The JSON result is written to ${OUT:-outputs/gpu_smoke_result.json}. PY: the python
# to use (default: the repository's .venv, else python on the PATH).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
PY="${PY:-$root/.venv/bin/python}"
[ -x "$PY" ] || PY=python
OUT="${OUT:-outputs/gpu_smoke_result.json}"
mkdir -p "$(dirname "$OUT")"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
else
  echo "no nvidia-smi: no NVIDIA GPU here (only --dry-run makes sense)"
fi
args=(--out "$OUT")
[ -n "${MODEL_DIR:-}" ] && args+=(--model_dir "$MODEL_DIR")
PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$here/gpu_smoke.py" "${args[@]}" "$@"
