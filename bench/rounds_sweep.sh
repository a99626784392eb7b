#!/usr/bin/env bash
# Rounds (issue 26) in `dcp simulate`: dcp-opt with rounds (train.max_rounds 0) against dcp-opt with one partition
# per step (--max-rounds 1) and against the best static layout (the faster of packed and bucket at every static
# SP size that divides the world and the heads), per workload and world size, under one cost model. Prints one
# markdown table: predicted epoch seconds, the ratios, lower_bound_ratio of both dcp-opt variants, the steps
# that use rounds and the planning time.
#
# usage: bash bench/rounds_sweep.sh DCP COST_MODEL [--config CFG | --lengths-config CFG] [OPTION...] -- WORKLOAD...
#          [-- WORLD_SIZES...]
#   WORKLOAD: a built-in name (opensora-zipf, lognormal, megatron-lognormal) or main-job (the sample lengths of
#   the main job's corpus: every non-empty *.txt under the config's data.path cut into data.max_seq_len chunks,
#   held-out documents included; needs --config or --lengths-config).
#   --config CFG is passed to `dcp simulate` (its model and memory sections: a CPU profile of that model);
#   --lengths-config CFG only gives main-job's lengths, planned for the cost model's default shape (h200: the
#   1.3B decoder; CFG's memory budget is not used). Other OPTIONs go to every `dcp simulate`.
set -euo pipefail
dcp=$1 cost=$2
shift 2
extra=()
config=""
lengths_config=""
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  if [ "$1" = "--lengths-config" ]; then lengths_config=$2; shift 2; continue; fi
  [ "$1" = "--config" ] && config=$2
  extra+=("$1")
  shift
done
[ -n "$lengths_config" ] || lengths_config=$config
[ $# -gt 0 ] && shift
workloads=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do workloads+=("$1"); shift; done
[ $# -gt 0 ] && shift
worlds=("$@")
[ ${#worlds[@]} -eq 0 ] && worlds=(2 4 8 16 64 256 1024)
work=$(mktemp -d /tmp/dcp_rounds_sweep.XXXXXX)
trap 'rm -rf "$work"' EXIT

# The model's KV heads bound the static SP sizes (Ulysses); 16 for the 1.3B decoder, the config's otherwise.
heads=16
if [ -n "$config" ]; then heads=$(awk '/^model:/{m=1} m && /n_heads:/{print $2; exit}' "$config"); fi
[ "$cost" != h200 ] && [ -z "$config" ] && heads=$(jq -r '.model.heads' "$cost")

echo "| workload | world_size | steps | dcp-opt rounds epoch_s | one partition epoch_s | best static epoch_s (layout) | rounds / one partition | rounds / best static | lower_bound_ratio rounds | lower_bound_ratio one partition | steps with rounds | rounds per step | plan ms/step rounds | plan ms/step one |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
for w in "${workloads[@]}"; do
  source=(--workload "$w")
  if [ "$w" = main-job ]; then
    [ -n "$lengths_config" ] || { echo "rounds_sweep.sh: main-job needs --config or --lengths-config" >&2; exit 2; }
    path=$(awk '/^data:/{d=1} d && /path:/{print $2; exit}' "$lengths_config")
    len=$(awk '/^data:/{d=1} d && /max_seq_len:/{print $2; exit}' "$lengths_config")
    find "$path" -name '*.txt' -size +0 -printf '%s\n' | sort -n |
      awk -v m="$len" '{n = $1; while (n > 0) { print (n > m ? m : n); n -= m } }' > "$work/main-job.txt"
    source=(--lengths "$work/main-job.txt")
  fi
  for n in "${worlds[@]}"; do
    sim() { "$dcp" simulate "${source[@]}" --world-size "$n" --cost-model "$cost" "${extra[@]}" --json "$@"; }
    rounds=$(sim --planners dcp-opt)
    one=$(sim --planners dcp-opt --max-rounds 1)
    best="" best_name=""
    for sp in 1 2 4 8 16 32 64 128 256 512 1024; do
      [ "$sp" -le "$n" ] && [ $((n % sp)) -eq 0 ] && [ $((heads % sp)) -eq 0 ] || continue
      out=$(sim --planners packed,bucket --static-sp "$sp" 2>/dev/null) || continue
      for p in packed bucket; do
        e=$(jq -r --arg p "$p" '.[] | select(.planner == $p and .samples_skipped == 0) | .predicted_epoch_s' <<<"$out")
        [ -n "$e" ] || continue
        if [ -z "$best" ] || awk -v a="$e" -v b="$best" 'BEGIN{exit !(a < b)}'; then best=$e best_name="$p sp $sp"; fi
      done
    done
    jq -rn --arg w "$w" --arg n "$n" --argjson R "$rounds" --argjson O "$one" --arg best "${best:-null}" \
       --arg bn "${best_name:-none}" '
      def f(x; d): (x * pow(10; d) | round) / pow(10; d);
      ($R[0]) as $r | ($O[0]) as $o |
      "| \($w) | \($n) | \($r.steps) | \(f($r.predicted_epoch_s; 3)) | \(f($o.predicted_epoch_s; 3)) | " +
      (if $best == "null" then "n/a | " else "\(f($best | tonumber; 3)) (\($bn)) | " end) +
      "\(f($o.predicted_epoch_s / $r.predicted_epoch_s; 4)) | " +
      (if $best == "null" then "n/a | " else "\(f(($best | tonumber) / $r.predicted_epoch_s; 4)) | " end) +
      "\(f($r.lower_bound_ratio; 4)) | \(f($o.lower_bound_ratio; 4)) | \($r.steps_with_rounds) | \(f($r.rounds_per_step; 2)) | \(f($r.plan_ms_per_step; 2)) | \(f($o.plan_ms_per_step; 2)) |"'
  done
done
