#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + coverage on the libraries they exercise) in
# build-fuzz/ and runs each briefly. Usage: tools/fuzz.sh [seconds per target, default 30].
# Exits 0 when clang is absent (nothing to do), non-zero when a fuzzer finds a crash.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-30}"
if ! command -v clang++ >/dev/null 2>&1; then
  echo "fuzz: clang++ not found; skipping"
  exit 0
fi
cmake -S . -B build-fuzz -G Ninja \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link" -DUCP_SANITIZE=address \
  -DUCP_BUILD_FUZZERS=ON -DUCP_FUZZ_SECONDS="$seconds" -DUCP_BUILD_EXAMPLES=OFF \
  -DUCP_BUILD_BENCHMARKS=OFF -DUCP_ENABLE_CUDA=OFF >/dev/null
cmake --build build-fuzz -j"$(nproc)" --target torch_fuzz safetensors_fuzz json_fuzz manifest_fuzz layout_fuzz rules_fuzz
ctest --test-dir build-fuzz -L fuzz --output-on-failure
