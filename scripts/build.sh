#!/usr/bin/env bash
# Configures and builds dcp into ./build (Release-with-debug-info, Ninja, 2 jobs by default).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${DCP_BUILD_JOBS:-$(nproc)}
cmake -S . -B build -G Ninja ${CMAKE_PREFIX_PATH:+-DCMAKE_PREFIX_PATH="$CMAKE_PREFIX_PATH"} >/dev/null
ninja -C build -j "$jobs"
