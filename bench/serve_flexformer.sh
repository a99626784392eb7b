#!/usr/bin/env bash
# dcp serve with a flexformer checkpoint beside a softmax one of the same shape (configs/kv_python_model.yaml:
# d_model 128, 4 layers, 4 heads), the same load, one after the other on the same machine and binary:
#   bash bench/serve_flexformer.sh [DCP_BINARY] [OUT_PREFIX]
# 1. trains the flexformer model (attention.backend flexformer, one 110-step cosine schedule; the config's own is 240)
#    unless runs/kv_python_flex/checkpoint exists, and a softmax model of the same shape for one step (its serving
#    cost per token does not depend on its training; it is the throughput twin, not a quality baseline) unless
#    runs/kv_python_softmax_twin/checkpoint exists;
# 2. runs `dcp bench-serve` on both with the same prompts (1-8 KB cut from the held-out CPython files), clients
#    1/4/16/64, 16-session batching runs and memory runs of 64 clients at one KV memory (what 4 full softmax caches
#    of the mean prompt need), policy full.
set -euo pipefail
cd "$(dirname "$0")/.."
dcp=${1:-build/dcp}
out=${2:-bench/results/cpu2_202612_serve_flexformer}
if [[ ! -f runs/kv_python_flex/checkpoint/state.json ]]; then
  "$dcp" train --config configs/kv_python_model.yaml --attention.backend=flexformer --run.dir=runs/kv_python_flex \
    --train.max_steps=110 --train.checkpoint_every=10
fi
if [[ ! -f runs/kv_python_softmax_twin/checkpoint/state.json ]]; then
  "$dcp" train --config configs/kv_python_model.yaml --run.dir=runs/kv_python_softmax_twin --train.max_steps=1 \
    --train.checkpoint_every=1
fi
load=(--clients 1,4,16,64 --requests 64 --min-prompt 1024 --max-prompt 8192 --max-tokens 128 --policies full
      --memory-clients 64 --memory-requests 64 --serve.threads=2)
"$dcp" bench-serve --checkpoint runs/kv_python_flex/checkpoint "${load[@]}" --out "$out"
"$dcp" bench-serve --checkpoint runs/kv_python_softmax_twin/checkpoint "${load[@]}" --out "${out}_softmax_twin"
