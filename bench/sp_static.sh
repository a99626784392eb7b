#!/usr/bin/env bash
# Static sequence parallelism on the default corpus, world_size 2: sp_size 1 (data parallel) vs sp_size 2.
# The variants alternate in rounds of STEPS steps (each resumes its own run), so machine drift hits both alike;
# both train the same samples in the same order. Writes a markdown table to bench/results/.
# Usage: bash bench/sp_static.sh [ROUNDS] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
steps=${2:-8}
out=bench/results/cpu2_$(date +%Y%m)_sp_static.md
work=$(mktemp -d)
total=$((rounds * steps))
common=(--config configs/default.yaml --train.max_steps=$total --train.stop_after_steps=$steps
        --train.checkpoint_every=0 --eval.max_tokens=4096)
for r in $(seq 1 "$rounds"); do
  for sp in 1 2; do
    resume=(); [ "$r" -gt 1 ] && resume=(--resume)
    ./build/dcp launch --nproc 2 -- train "${common[@]}" --parallel.sp_size=$sp --run.dir="$work/sp$sp" "${resume[@]}" \
      > "$work/sp$sp.round$r.log" 2>&1
  done
done
{
  echo "# Static SP on the default corpus, world_size 2, 2 cores ($(date +%Y-%m-%d))"
  echo
  echo "Command: \`bash bench/sp_static.sh $rounds $steps\` ($rounds alternating rounds of $steps steps per variant;"
  echo "the first step of each round is excluded as warm-up; configs/default.yaml, 16K tokens per step)."
  echo
  echo "| sp_size | steps measured | tokens/s (mean) | step_time_s (median) | imbalance (mean) | ratio to sp_size 1 |"
  echo "|---|---|---|---|---|---|"
  base=""
  for sp in 1 2; do
    # Drop the first step of every round (process start, lazy allocations).
    stats=$(jq -s --argjson steps "$steps" '
      [ .[] | select(((.step - 1) % $steps) != 0) ] as $m
      | { n: ($m | length),
          tps: (($m | map(.tokens) | add) / ($m | map(.step_time_s) | add)),
          med: ($m | map(.step_time_s) | sort | .[(length / 2 | floor)]),
          imb: (($m | map(.imbalance) | add) / ($m | length)) }' "$work/sp$sp/metrics.jsonl")
    tps=$(jq '.tps' <<<"$stats")
    [ -z "$base" ] && base=$tps
    jq -r --argjson sp "$sp" --argjson base "$base" \
      '"| \($sp) | \(.n) | \(.tps | floor) | \(.med * 1000 | round / 1000) | \(.imb * 1000 | round / 1000) | \(.tps / $base * 100 | round / 100) |"' \
      <<<"$stats"
  done
} > "$out"
cat "$out"
rm -rf "$work"
