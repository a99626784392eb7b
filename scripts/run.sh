#!/usr/bin/env bash
# README command 1: install what is missing, build, train the default model with 2 ranks on the default
# corpus (CPython 3.11 docs), then print a sample from the trained checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
run_dir=${DCP_RUN_DIR:-runs/default}
./build/dcp launch --nproc 2 -- train --config configs/default.yaml --run.dir="$run_dir" "$@"
echo
echo "== summary ($run_dir/summary.json)"
cat "$run_dir/summary.json"
echo
echo "== sample: dcp generate --checkpoint $run_dir/checkpoint --prompt 'The Python ' --max-new-tokens 300"
./build/dcp generate --checkpoint "$run_dir/checkpoint" --prompt "The Python " --max-new-tokens 300 \
  --temperature 0.8 --top-k 40 --seed 1
