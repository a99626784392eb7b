#!/usr/bin/env bash
# Held-out bits per byte of the attention backends at equal parameters (up to the few frequency and shift
# parameters) and equal training tokens: the config trained once per variant on 2 ranks, same samples in the
# same order, same seed. Writes a markdown table to bench/results/ and keeps the runs under OUT.
# Usage: [CONFIG=FILE] bash bench/attention_quality.sh [OUT] [extra --section.key=value overrides for every run ...]
# (CONFIG and OUT, when relative, are taken from the repository root: the script works there.)
# CONFIG defaults to configs/default.yaml, the main job. The published table
# (bench/results/cpu2_202612_attention_quality.md) was measured at commit e917eb0 on the default job of that time
# (16K tokens per step), not on today's.
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir=${1:-runs/attention_quality}
config=${CONFIG:-configs/default.yaml}
[ -f "$config" ] || { echo "attention_quality.sh: config file $config does not exist" >&2; exit 2; }
[ -x build/dcp ] || { echo "attention_quality.sh: build/dcp not found (relative to the repository root $(pwd)): build it first (scripts/build.sh or the README's test command)" >&2; exit 2; }
mkdir -p "$out_dir"
shift || true
result=bench/results/cpu$(nproc)_$(date +%Y%m)_attention_quality.md
variants=(
  "softmax|--attention.backend=softmax"
  "flexformer-stationary|--attention.backend=flexformer --attention.feature_map=stationary"
  "fixed-frequency|--attention.backend=flexformer --attention.feature_map=fixed"
  "flexformer-nonstationary|--attention.backend=flexformer --attention.feature_map=nonstationary"
  "elu+1|--attention.backend=flexformer --attention.feature_map=elu"
)
for v in "${variants[@]}"; do
  name=${v%%|*}
  read -r -a keys <<<"${v#*|}"
  if [ ! -f "$out_dir/$name/summary.json" ]; then
    echo "training $name ..." >&2
    ./build/dcp launch --nproc 2 -- train --config "$config" --run.dir="$out_dir/$name" "${keys[@]}" "$@" \
      > "$out_dir.$name.log" 2>&1 || { echo "$name failed, see $out_dir.$name.log" >&2; exit 1; }
  fi
done
{
  echo "# Attention backends at equal tokens on the corpus of $config ($(date +%Y-%m-%d), $(nproc) CPU threads)"
  echo
  model=$(awk '/^model:/{m=1;next} /^[^ ]/{m=0} m && /^  (d_model|n_layers|n_heads):/{printf "%s%s %s", sep, $1, $2; sep=", "}' "$out_dir/softmax/config.yaml")
  echo "Command: \`CONFIG=$config bash bench/attention_quality.sh $out_dir $*\` ($model,"
  echo "$(jq .steps "$out_dir/softmax/summary.json") steps of $(jq '.tokens_trained / .steps | round' "$out_dir/softmax/summary.json") tokens on average, 2 ranks; flexformer defaults: m = 64,"
  echo "input_norm l2, normalizer shift). Held-out bpb over the first eval.max_tokens held-out tokens."
  echo
  echo "| variant | parameters | tokens trained | held-out bpb initial | held-out bpb final | ratio to softmax |"
  echo "|---|---|---|---|---|---|"
  base=$(jq '.heldout_bits_per_byte_final' "$out_dir/softmax/summary.json")
  for v in "${variants[@]}"; do
    name=${v%%|*}
    jq -r --arg n "$name" --argjson base "$base" \
      '"| \($n) | \(.parameters) | \(.tokens_trained) | \(.heldout_bits_per_byte_initial * 1000 | round / 1000) | \(.heldout_bits_per_byte_final * 1000 | round / 1000) | \(.heldout_bits_per_byte_final / $base * 1000 | round / 1000) |"' \
      "$out_dir/$name/summary.json"
  done
} > "$result"
cat "$result"
