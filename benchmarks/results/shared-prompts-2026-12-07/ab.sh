cd /work/main
for r in 1 2 3; do
  for row in "short online_dpo" "short rloo" "long rloo" "long online_dpo" "long grpo"; do
    set -- $row
    if [ $1 = long ]; then export ART=$HOME/.cache/posttrain-bench/artifacts-long; else export ART=$HOME/.cache/posttrain-bench/artifacts; fi
    echo "$r $1 old $(SRC=/tmp/old/src /tmp/ours_only.sh $2 14m)"
    echo "$r $1 new $(/tmp/ours_only.sh $2 14m)"
  done
done
echo ABDONE
