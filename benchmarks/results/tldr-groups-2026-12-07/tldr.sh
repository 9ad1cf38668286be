#!/usr/bin/env bash
# usage: tldr.sh OUTDIR [extra args]
cd /work/main
A=$HOME/.cache/posttrain-bench/artifacts
OUTD=$1; shift
rm -rf $OUTD
export ACCELERATE_USE_CPU=true OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=${SRC:-src}
start=$(date +%s.%N)
/usr/bin/time -v -o $OUTD.time .venv/bin/torchrun --nproc_per_node 2 examples/scripts/rloo/rloo_tldr.py --dataset_name $A-long/prompts --num_ppo_epochs 2 --num_mini_batches 2 --per_device_train_batch_size 8 --gradient_accumulation_steps 8 --total_episodes 512 --model_name_or_path $A/policy-14m --sft_model_path $A/policy-14m --reward_model_path $A/reward-14m --local_rollout_forward_batch_size 16 --missing_eos_penalty 1.0 --stop_token eos --response_length 53 --output_dir $OUTD "$@" > $OUTD.log 2>&1
rc=$?
end=$(date +%s.%N)
echo "rc=$rc wall=$(python3 -c "print(round($end-$start,1))") rss=$(awk -F': ' '/Maximum resident/{printf "%.0f", $2/1024}' $OUTD.time)"
grep -o "'eps': [0-9.]*" $OUTD.log | tail -2; head -c 600 $OUTD/metrics.jsonl 2>/dev/null; echo
