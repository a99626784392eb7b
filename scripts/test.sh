#!/usr/bin/env bash
# README command 2: install what is missing, build, run every test with CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
cd build
ctest --output-on-failure "$@"
