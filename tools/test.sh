#!/usr/bin/env bash
# Sets up, builds and runs the default test suite (everything but the `slow` and `gpu` labels).
# Usage: tools/test.sh [ctest args]; e.g. tools/test.sh -L slow for the large cases.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/build.sh
cd build
if [ $# -eq 0 ]; then set -- -LE 'slow|gpu'; fi
ctest --output-on-failure -j"${UCP_JOBS:-$(nproc)}" "$@"
