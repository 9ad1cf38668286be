#!/usr/bin/env bash
# ours_only.sh TRAINER SIZE -> "TRAINER SIZE eps rss" for posttrain alone (env passes through)
set -uo pipefail
T=$1; SIZE=$2; SB=/work/main/../shared/bench
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
export RUNS=$W/runs SIZE PYTHONHASHSEED=0 OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=${SRC:-/work/main/src}
(cd "$W" && /usr/bin/time -v -o "$W/t" /work/main/.venv/bin/python "$SB/run_posttrain.py" "$SB" "run_$T.py" > "$W/l" 2>&1) || { echo "failed: $(tail -n 3 $W/l)"; exit 1; }
e=$(sed -n 's/^RESULT //p' "$W/l" | tail -n 1 | python3 -c "import json,sys; print(json.load(sys.stdin)['eps_wall'])")
r=$(awk -F': ' '/Maximum resident/{printf "%.0f", $2/1024}' "$W/t")
echo "$T $SIZE $e $r"
