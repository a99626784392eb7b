#!/usr/bin/env bash
# The default job's training throughput, side by side in one run: dcp with the tiled attention and with its
# reference twin, each in bf16 and fp32, the same model as plain PyTorch loops (bench/pytorch_loop.py: fp32,
# bf16 autocast, bf16 autocast with row-blocked attention) and, when given, an older dcp binary. Every entry trains
# the default config on 2 ranks x 1 thread for STEPS steps; tokens/s counts the steps after the first 2. MFU =
# model FLOPs per second (dcp's cost-model count: 6 per parameter per token plus causal attention, metrics.jsonl
# model_flops; the same count for the other entries, which train the same model on the same tokens) / (the
# one-thread matmul peak of the entry's dtype, measured here by dcp bench-attention, x 2 ranks).
#
# usage: bash bench/default_job.sh [STEPS] [OUT.md]   (env: DCP_BASELINE=/path/to/old/build/dcp, REPETITIONS=2)
# The entries take turns repetition by repetition, so machine drift hits all of them alike; each entry's figure
# is its best repetition.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-30}
out=${2:-bench/results/cpu$(nproc)_$(date +%Y%m)_default_job.md}
repetitions=${REPETITIONS:-2}
work=$(mktemp -d /tmp/dcp_default_job.XXXXXX)
trap 'rm -rf "$work"' EXIT
dcp=./build/dcp
[ -x "$dcp" ] || { echo "default_job.sh: build first (bash scripts/build.sh)" >&2; exit 2; }
# tokens/s counts the steps after the first 2, so at least 3.
[[ "$steps" =~ ^[0-9]+$ ]] && [ "$steps" -ge 3 ] || { echo "default_job.sh: STEPS must be an integer >= 3, not '$steps'" >&2; exit 2; }
# The report is written after ~20 minutes of training: check now that it can be.
mkdir -p "$(dirname "$out")" 2>/dev/null && touch "$out" 2>/dev/null || {
  echo "default_job.sh: cannot write the report '$out'" >&2; exit 2; }
# The PyTorch loops need Debian's python3-torch.
/usr/bin/python3 -c 'import torch' 2>/dev/null || bash scripts/install-deps.sh python3-torch || {
  echo "default_job.sh: the PyTorch loops need python3-torch (apt-get install python3-torch, as root)" >&2; exit 2; }

# Matmul peaks of this machine (one thread, 2048^3), from the bench-attention header.
$dcp bench-attention --lengths 512 --variants softmax --repetitions 1 --threads 1 --no-plot --out "$work/peak" >/dev/null
peak_line=$(grep -o 'fp32 [0-9.]* GFLOP/s, bf16 [0-9.]* GFLOP/s' "$work/peak.md")
peak_fp32=$(echo "$peak_line" | awk '{print $2}')
peak_bf16=$(echo "$peak_line" | awk '{print $5}')

# The PyTorch loops get the OpenBLAS kernels dcp gives itself (src/cli/blas_cores.cpp): on a virtual CPU
# OpenBLAS does not recognise it falls back to its Prescott kernels, 4-5x slower in fp32 on AVX-512.
coretype=${OPENBLAS_CORETYPE:-}
if [ -z "$coretype" ] && grep -qw avx512f /proc/cpuinfo; then
  coretype=SkylakeX; grep -qw avx512_bf16 /proc/cpuinfo && coretype=Cooperlake
fi
py="/usr/bin/python3"
[ -n "$coretype" ] && py="env OPENBLAS_CORETYPE=$coretype /usr/bin/python3"

# name|kind|command (kind: dcp = a run dir with metrics.jsonl, json = one JSON line with tokens_per_s)
entries=(
  "dcp tiled bf16|dcp|$dcp launch --nproc 2 -- train --config configs/default.yaml --train.precision=bf16 --attention.impl=tiled"
  "dcp tiled fp32|dcp|$dcp launch --nproc 2 -- train --config configs/default.yaml --train.precision=fp32 --attention.impl=tiled"
  "dcp reference bf16|dcp|$dcp launch --nproc 2 -- train --config configs/default.yaml --train.precision=bf16 --attention.impl=reference"
  "dcp reference fp32|dcp|$dcp launch --nproc 2 -- train --config configs/default.yaml --train.precision=fp32 --attention.impl=reference"
  "PyTorch fp32|json|$py bench/pytorch_loop.py --nproc 2 --threads 1"
  "PyTorch bf16 autocast|json|$py bench/pytorch_loop.py --nproc 2 --threads 1 --autocast"
  "PyTorch bf16 autocast, blocked attention|json|$py bench/pytorch_loop.py --nproc 2 --threads 1 --autocast --attention blocked"
)
if [ -n "${DCP_BASELINE:-}" ]; then
  # The old binary as a user runs it, and with OpenBLAS's AVX-512 kernels forced (it predates the re-exec).
  entries+=("baseline $(basename "$(dirname "$(dirname "$DCP_BASELINE")")")|dcp|$DCP_BASELINE launch --nproc 2 -- train --config configs/default.yaml")
  entries+=("baseline $(basename "$(dirname "$(dirname "$DCP_BASELINE")")"), OPENBLAS_CORETYPE=Cooperlake|dcp|env OPENBLAS_CORETYPE=Cooperlake $DCP_BASELINE launch --nproc 2 -- train --config configs/default.yaml")
fi

declare -A best flops_per_token
for rep in $(seq 1 "$repetitions"); do
  for i in "${!entries[@]}"; do
    IFS='|' read -r name kind cmd <<<"${entries[$i]}"
    run="$work/run_${i}_${rep}"
    if [ "$kind" = dcp ]; then
      $cmd --run.dir="$run" --train.max_steps="$steps" --train.checkpoint_every=0 --eval.max_tokens=8192 \
        >"$run.log" 2>&1 || { echo "default_job.sh: '$name' failed, see its log:" >&2; cat "$run.log" >&2; exit 1; }
      tps=$(jq -s '[.[2:][]] | (map(.tokens) | add) / (map(.step_time_s) | add)' "$run/metrics.jsonl")
      fpt=$(jq -s '[.[2:][]] | (map(.model_flops // 0) | add) / (map(.tokens) | add)' "$run/metrics.jsonl")
      [ "$fpt" != "0" ] && flops_per_token[$name]=$fpt
    else
      tps=$($cmd --steps "$steps" 2>"$run.log" | tail -1 | jq .tokens_per_s)
    fi
    echo "repetition $rep: $name: $tps tokens/s"
    if [ -z "${best[$name]:-}" ] || awk "BEGIN{exit !($tps > ${best[$name]})}"; then best[$name]=$tps; fi
  done
done

fpt=${flops_per_token["dcp tiled bf16"]}
pytorch_best=0
for name in "PyTorch fp32" "PyTorch bf16 autocast" "PyTorch bf16 autocast, blocked attention"; do
  awk "BEGIN{exit !(${best[$name]} > $pytorch_best)}" && pytorch_best=${best[$name]}
done
{
  echo "# Default job throughput, side by side ($(date -u +%Y-%m-%d), $(nproc) hardware threads)"
  echo
  echo "Command: \`bash bench/default_job.sh $steps${2:+ $2}\`${DCP_BASELINE:+ with DCP_BASELINE=$DCP_BASELINE}, REPETITIONS=$repetitions."
  echo
  echo "configs/default.yaml (0.9M parameters, 4 layers, 4 heads x 32, 512-byte samples, 16K tokens per step) on"
  echo "2 ranks x 1 thread, $steps steps per entry, tokens/s over the steps after the first 2, best of $repetitions repetitions"
  echo "taken in turns. Matmul peak of one thread (2048^3, measured by this run): fp32 $peak_fp32 GFLOP/s, bf16"
  echo "$peak_bf16 GFLOP/s. Model FLOPs per token: $(printf '%.3g' "$fpt") (dcp's cost model: 6 per parameter per"
  echo "token plus causal attention; the same model and tokens for every entry). MFU = tokens/s x FLOPs per token /"
  echo "(peak of the entry's dtype x 2 ranks). The PyTorch loops ran with OPENBLAS_CORETYPE=${coretype:-unset}."
  echo "Load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)."
  echo
  echo "| entry | tokens/s | vs best PyTorch loop | MFU |"
  echo "|---|---|---|---|"
  for e in "${entries[@]}"; do
    IFS='|' read -r name _ _ <<<"$e"
    peak=$peak_fp32
    case "$name" in *bf16*|*"dcp tiled bf16"*) peak=$peak_bf16 ;; esac
    case "$name" in baseline*) peak=$peak_fp32 ;; esac
    awk -v n="$name" -v t="${best[$name]}" -v p="$pytorch_best" -v f="$fpt" -v k="$peak" \
      'BEGIN{printf "| %s | %.0f | %.2fx | %.1f%% |\n", n, t, t / p, 100 * t * f / (k * 1e9 * 2)}'
  done
} >"$out"
echo "wrote $out"
cat "$out"
