#!/usr/bin/env bash
# Configures and builds ucp in build/ (Release with debug info). Usage: tools/build.sh [cmake args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
jobs=${UCP_JOBS:-$(nproc)}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
cmake --build build -j"$jobs"
