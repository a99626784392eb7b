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
  libpython3.11-stdlib                            # configs/kv_python_model.yaml's corpus: CPython 3.11 stdlib .py files
  libcpp-httplib-dev                              # dcp serve's HTTP server (cpp-httplib, as llama.cpp's server)
  chromium                                        # the serve page's browser test (headless, driven by playwright-core)
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
# The serve page's browser test drives chromium through playwright-core, pinned by tests/browser/package-lock.json
# (no browser download: the test runs Debian's /usr/bin/chromium).
root="$(cd "$(dirname "$0")/.." && pwd)"
if [ ! -d "$root/tests/browser/node_modules/playwright-core" ]; then
  if ! command -v npm >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq   # also when every package above was already there
    apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
  fi
  echo "dcp: installing playwright-core into tests/browser"
  (cd "$root/tests/browser" && npm ci --no-audit --no-fund --loglevel=error)
fi
