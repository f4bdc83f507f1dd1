#!/usr/bin/env bash
# Sets up, builds and runs the default test suite (everything but the `slow` and `gpu` labels),
# after building the libFuzzer targets with clang (where installed) and running each for 15 s.
# Usage: tools/test.sh [ctest args]; e.g. tools/test.sh -L slow for the large cases (no fuzzing
# when arguments are given).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/build.sh
if [ $# -gt 0 ]; then
  ctest --test-dir build --output-on-failure -j"${UCP_JOBS:-$(nproc)}" "$@"
  exit
fi
# Fuzz first, so the main suite's summary is the last thing printed.
bash tools/fuzz.sh "${UCP_FUZZ_SECONDS:-15}"
ctest --test-dir build --output-on-failure -j"${UCP_JOBS:-$(nproc)}" -LE 'slow|gpu'
