#!/usr/bin/env bash
# Time one posttrain trainer under /usr/bin/time -v, like shared/bench/run.sh times TRL's.
#   Usage: bash benchmarks/run_ours.sh TRAINER [SIZE]
#   TRAINER: ppo                         -> benchmarks/bench_ppo.py
#            rloo | grpo | rloo_grpo     -> benchmarks/bench_rloo_grpo.py      (TRAINER exported for the script)
#            online_dpo | xpo            -> benchmarks/bench_online_dpo_xpo.py (TRAINER exported for the script)
#            path/to/script.py           -> that script
#   SIZE: 14m (default) | 70m. Knobs by environment as in shared/bench/common.py: EPISODES BATCH K RESP_LEN
#   PPO_EPOCHS LR SEED TEMP BF16 THREADS ART RUNS, and GC=1 (gradient checkpointing, posttrain only); PYTHON picks
#   the interpreter (default: the project venv).
# The script must print "RESULT_DIR <dir>" and write <dir>/result.json; peak RSS and process wall time are added.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
T=$1; export SIZE=${2:-${SIZE:-14m}}
case $T in
  ppo) SCRIPT=$HERE/bench_ppo.py ;;
  rloo|grpo|rloo_grpo) SCRIPT=$HERE/bench_rloo_grpo.py ;;
  online_dpo|xpo) SCRIPT=$HERE/bench_online_dpo_xpo.py ;;
  *.py) SCRIPT=$(cd "$(dirname "$T")" && pwd)/$(basename "$T") ;;
  *) echo "unknown trainer '$T' (ppo | rloo | grpo | rloo_grpo | online_dpo | xpo | path/to/script.py)"; exit 2 ;;
esac
[ -f "$SCRIPT" ] || { echo "no benchmark script $SCRIPT"; exit 2; }
export TRAINER=$T
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
BENCH=${POSTTRAIN_BENCH:-$HOME/.cache/posttrain-bench}
export ART=${ART:-$BENCH/artifacts} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       TOKENIZERS_PARALLELISM=false PYTHONHASHSEED=0
TMP=$(mktemp -d)
cd "$TMP" && /usr/bin/time -v -o "$TMP/time.txt" "$PYTHON" "$SCRIPT" > "$TMP/run.log" 2>&1 \
  || { tail -30 "$TMP/run.log"; echo "FAILED: $T (log $TMP/run.log)"; exit 1; }
DIR=$(sed -n 's/^RESULT_DIR //p' "$TMP/run.log")
cp "$TMP/run.log" "$TMP/time.txt" "$DIR/" && rm -rf "$TMP"
"$PYTHON" - "$DIR" <<'PY'
import json, re, sys
d = sys.argv[1]; t = open(f"{d}/time.txt").read(); r = json.load(open(f"{d}/result.json"))
r["peak_rss_mb"] = round(int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", t)[1]) / 1024, 1)
w = re.search(r"Elapsed \(wall clock\) time.*: (.*)", t)[1].split(":")
r["process_wall_s"] = round(sum(float(x) * 60 ** i for i, x in enumerate(reversed(w))), 1)
r["cpu_percent"] = re.search(r"Percent of CPU this job got: (\d+)%", t)[1]
json.dump(r, open(f"{d}/result.json", "w"), indent=1)
lib = r.get("library", "posttrain")
print(f"{r['trainer']:20s} {lib:16s} {r['size']} train {r['train_wall_s']}s  eps {r['eps_wall']} "
      f"(logged {r.get('eps_logged_last')})  process {r['process_wall_s']}s  CPU {r['cpu_percent']}%  "
      f"peak RSS {r['peak_rss_mb']} MB  -> {d}")
PY
