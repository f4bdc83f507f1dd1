#!/usr/bin/env bash
# Configures and builds ucp in build/ (Release with debug info). Usage: tools/build.sh [cmake args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
jobs=${UCP_JOBS:-$(nproc)}
# ccache, where installed, makes rebuilds and extra build folders cheap; CI works without it.
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${launcher[@]}" "$@" >/dev/null
cmake --build build -j"$jobs"
