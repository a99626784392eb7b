#!/usr/bin/env bash
# dcp-opt's lower_bound_ratio and planning time over world sizes (powers of two and not), on opensora-zipf and
# lognormal, analytic h200 model: `dcp simulate --workload W --world-size N --planners dcp-opt --cost-model h200`.
# Each LABEL=BINARY is a dcp build (e.g. before=/tmp/dcp-before after=build/dcp); prints one markdown table with
# lower_bound_ratio and plan_ms_per_step per build.
# Usage: bash bench/planner_sweep.sh LABEL=BINARY... [-- WORLD_SIZES...]
set -euo pipefail
builds=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do builds+=("$1"); shift; done
[ $# -gt 0 ] && shift
worlds=("$@")
[ ${#worlds[@]} -eq 0 ] && worlds=(8 12 16 24 32 48 64 96 128 192 256 384 512 768 1024)
header="| workload | world_size |"
rule="|---|---|"
for b in "${builds[@]}"; do
  header+=" ${b%%=*} lower_bound_ratio | ${b%%=*} plan_ms_per_step |"
  rule+="---|---|"
done
echo "$header"
echo "$rule"
for w in opensora-zipf lognormal; do
  for n in "${worlds[@]}"; do
    row="| $w | $n |"
    for b in "${builds[@]}"; do
      out=$("${b#*=}" simulate --workload "$w" --world-size "$n" --planners dcp-opt --cost-model h200 --json)
      row+=$(jq -r '.[0] | " \(.lower_bound_ratio * 10000 | round / 10000) | \(.plan_ms_per_step * 100 | round / 100) |"' <<<"$out")
    done
    echo "$row"
  done
done
