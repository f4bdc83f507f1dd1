#!/usr/bin/env bash
# Sets up (tools/setup.sh, tools/setup_peers.sh), builds and runs the default test suite
# (everything but the `slow` and `gpu` labels, so the `peer` tests against the real DeepSpeed too),
# after building the libFuzzer targets with clang (where installed) and running each for 15 s.
# Usage: tools/test.sh [ctest args]; e.g. tools/test.sh -L slow for the large cases (no fuzzing
# when arguments are given).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/build.sh
# The peer tests need the two peer venvs; without PyPI they fail (they are not skipped), and the
# rest of the suite still runs.
bash tools/setup_peers.sh ||
  echo "test: a peer venv could not be made (above), so the peer tests (label peer) will fail"
if [ $# -gt 0 ]; then
  ctest --test-dir build --output-on-failure -j"${UCP_JOBS:-$(nproc)}" "$@"
  exit
fi
# Fuzz first, so the main suite's summary is the last thing printed.
bash tools/fuzz.sh "${UCP_FUZZ_SECONDS:-15}"
ctest --test-dir build --output-on-failure -j"${UCP_JOBS:-$(nproc)}" -LE 'slow|gpu'
