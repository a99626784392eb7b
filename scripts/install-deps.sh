#!/usr/bin/env bash
# Installs the Debian 12 packages dcp needs to build, test and run (as root), plus any named as arguments (the
# benchmarks' extras, e.g. python3-torch). Skips what is already there.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config
  libtorch-dev libgloo-dev libopenblas0-openmp   # LibTorch (CPU), c10d Gloo headers, fast BLAS for LibTorch
  libyaml-cpp-dev libcli11-dev nlohmann-json3-dev libspdlog-dev libfmt-dev zlib1g-dev
  libzip-dev                                      # checkpoints: the CRC32 of every entry inside model.pt and optimizer.pt
  libgtest-dev libgmock-dev libbenchmark-dev
  gnuplot-nox jq                                  # plots; jq summarises metrics.jsonl in bench scripts
  python3.11-doc                                  # the default corpus: CPython 3.11 docs sources
  "$@"
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "dcp: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
