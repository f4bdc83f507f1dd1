#!/usr/bin/env bash
# Installs this build of ucp into a temporary prefix, then configures and builds
# examples/consumer (a separate CMake project) against it with find_package(ucp), and runs it.
set -euo pipefail
src=$1 build=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
# The bash completion script generated from the command table is installed where
# bash-completion looks, and completes the commands.
completion=$work/prefix/share/bash-completion/completions/ucp
bash -c 'source "$1"; COMP_WORDS=(ucp conv); COMP_CWORD=1; _ucp; [ "${COMPREPLY[*]}" = convert ]' \
  _ "$completion" || { echo "no working bash completion at $completion"; exit 1; }
cmake -S "$src/examples/consumer" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/build" >/dev/null
out=$("$work/build/ucp_consumer")
# bf16 of 1.0, 3.14159 (rounds to 3.140625), -2.5
expected=$'0x3f80\n0x4049\n0xc020'
if [ "$out" != "$expected" ]; then
  echo "consumer printed:"; echo "$out"; echo "expected:"; echo "$expected"; exit 1
fi
echo "consumer built against the installed ucp and printed the expected values"
