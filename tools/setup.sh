#!/usr/bin/env bash
# Installs the Debian packages that ucp's build, tests and fixture scripts need, when missing.
# Idempotent: a second run installs nothing. Needs root (or sudo) only when something is missing.
set -euo pipefail

packages=(
  cmake ninja-build g++ pkg-config
  libhdf5-dev hdf5-tools nlohmann-json3-dev libzstd-dev zstd libxxhash-dev
  libboost-program-options-dev libtbb-dev libgtest-dev libgmock-dev
  libopenmpi-dev openmpi-bin
  python3 python3-numpy python3-h5py python3-torch python3-jsonschema
  python3-venv  # tools/setup_peers.sh: the DeepSpeed venv of the peer tests
  g++-aarch64-linux-gnu qemu-user  # offload/: NEON/SVE cross-compile and qemu test
  libopenblas-dev  # offload/model: CPU matrix products (docs/adr/0007)
  fortunes         # offload/data: the built-in English training corpus
  valgrind         # tests/corrupt: HDF5's error path on corrupt metadata, checked clean
  python3-matplotlib  # tools/plot_loss.py: loss curves of ucp-train runs
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "setup: all build and test dependencies present"
