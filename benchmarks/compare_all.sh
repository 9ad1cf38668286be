#!/usr/bin/env bash
# Every TRL-comparison row, N times, through ../shared/bench/compare.sh (TRL's own run_<trainer>.py on
# TRL, then unchanged on posttrain, back to back), then one table of medians.
#
#   Usage: bash benchmarks/compare_all.sh [TRAINER:SIZE ...]      (default: every row below)
#   Rows:  rloo:14m ppo:14m online_dpo:14m xpo:14m   against TRL 0.19.1 (venv-trl-old)
#          grpo:14m rloo_grpo:14m                    against TRL 1.16   (venv-trl)
#          rloo:70m ppo:70m                          against TRL 0.19.1
#   Environment:
#     N            repeats of every row (default 3); the rows are interleaved, one pass after another
#     SHARED_BENCH the reference harness (default: ../shared/bench next to the repository)
#     PT_PYTHON    interpreter with posttrain's dependencies (default: .venv/bin/python of the repository);
#                  posttrain itself is imported from this checkout's src/ (PYTHONPATH)
#     LOCK         a file to flock around each TRL + posttrain pair (default: $BENCH_LOCK, or none)
#     ART          the artifacts both libraries read (default: the bench's); benchmarks/build_long_prompts.py
#                  makes a copy with TL;DR-shaped prompts (~400 tokens) for the same rows
#     OUT          result folder (default: benchmarks/results/compare-<UTC date-time>): raw.txt (one line per
#                  pair: repeat, then compare.sh's line), table.md
#
# rloo_grpo: TRL 1.16's run_rloo_grpo.py calls RLOOTrainer with TRL 1.x's names (num_generations, beta,
# model=/reward_funcs=/args=), which posttrain's RLOOConfig / RLOOTrainer accept as they are. That row runs
# compare.sh from a mirror of SHARED_BENCH whose posttrain_shim is benchmarks/curves_shim: the strict shim,
# which drops no keyword (the shared one drops config keywords posttrain lacks), so the row fails rather
# than time a run with a setting left out. Every other row uses SHARED_BENCH as it is.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
SB=${SHARED_BENCH:-$(cd "$ROOT/.." && pwd)/shared/bench}
N=${N:-3}
LOCK=${LOCK:-${BENCH_LOCK:-}}
export PT_PYTHON=${PT_PYTHON:-$ROOT/.venv/bin/python}
export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-$HERE/results/compare-$(date -u +%Y%m%dT%H%M%SZ)}
[ -f "$SB/compare.sh" ] || { echo "no $SB/compare.sh: set SHARED_BENCH to the reference harness"; exit 2; }
[ -x "$PT_PYTHON" ] || { echo "PT_PYTHON=$PT_PYTHON is not an interpreter"; exit 2; }
ROWS=("$@")
[ ${#ROWS[@]} -gt 0 ] || ROWS=(rloo:14m ppo:14m online_dpo:14m xpo:14m grpo:14m rloo_grpo:14m rloo:70m ppo:70m)
for row in "${ROWS[@]}"; do
  case ${row%%:*} in rloo|ppo|online_dpo|xpo|grpo|rloo_grpo) ;; *) echo "unknown trainer in '$row'"; exit 2 ;; esac
  case $row in *:14m|*:70m) ;; *) echo "'$row': give TRAINER:SIZE with SIZE 14m or 70m"; exit 2 ;; esac
done
mkdir -p "$OUT"

# the mirror for rloo_grpo: every file of SHARED_BENCH linked, posttrain_shim replaced by curves_shim
MIRROR=$(mktemp -d); trap 'rm -rf "$MIRROR"' EXIT
for f in "$SB"/*; do [ "$(basename "$f")" = posttrain_shim ] || ln -s "$f" "$MIRROR/"; done
ln -s "$HERE/curves_shim" "$MIRROR/posttrain_shim"

for rep in $(seq 1 "$N"); do
  for row in "${ROWS[@]}"; do
    t=${row%%:*}; size=${row##*:}
    bench=$SB; [ "$t" = rloo_grpo ] && bench=$MIRROR
    cmd=(bash "$bench/compare.sh" "$t" "$size")
    [ -n "$LOCK" ] && cmd=(flock "$LOCK" "${cmd[@]}")
    line=$("${cmd[@]}" 2>&1 | tail -n 1)
    echo "$rep $t $size | $line" | tee -a "$OUT/raw.txt"
  done
done

python3 - "$OUT/raw.txt" <<'PY' | tee "$OUT/table.md"
import re, statistics as st, sys
label = {"rloo": "RLOO classic (k=2)", "ppo": "PPO (critic)", "online_dpo": "Online DPO", "xpo": "XPO",
         "grpo": "GRPO (k=2, beta 0.05)", "rloo_grpo": "RLOO GRPO-style (k=2)"}
order = ["rloo:14m", "ppo:14m", "online_dpo:14m", "xpo:14m", "grpo:14m", "rloo_grpo:14m", "rloo:70m", "ppo:70m"]
rows, failed = {}, {}
for raw in open(sys.argv[1]):
    head, _, line = raw.partition(" | ")
    _, t, size = head.split()
    key = f"{t}:{size}"
    parts = line.split()
    if len(parts) == 8 and parts[0] == t and re.fullmatch(r"[\d.]+", parts[2]):
        rows.setdefault(key, []).append([float(x) for x in parts[2:]])
    else:
        failed.setdefault(key, []).append(line.strip())
print("| trainer | model | TRL | pairs | TRL eps/s | posttrain eps/s | speed-up (median of pairs) | TRL peak RSS MB |"
      " posttrain peak RSS MB | RSS ratio (median of pairs) |")
print("|---|---|---|---|---|---|---|---|---|---|")
for key in sorted(set(rows) | set(failed), key=lambda k: order.index(k) if k in order else 99):
    t, size = key.split(":")
    trl = "1.16" if t in ("grpo", "rloo_grpo") else "0.19.1"
    rs = rows.get(key, [])
    if rs:
        med = [st.median(r[i] for r in rs) for i in range(6)]
        print(f"| {label[t]} | {size} | {trl} | {len(rs)} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f}× | {med[3]:.0f} |"
              f" {med[4]:.0f} | {med[5]:.2f} |")
    for why in failed.get(key, []):
        print(f"| {label[t]} | {size} | {trl} | failed | {why} | | | | | |")
PY
echo "raw lines and table: $OUT"
