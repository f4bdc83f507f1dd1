#!/usr/bin/env bash
# Packs what the device run needs into .gpu_bundle/ (git-ignored; the device tool carries it):
# the gpu-labelled test binaries, the model bench and ucp-bench (train --device cuda), built HERE with CUDA (sm_90) and stripped,
# with the shared libraries they link that a bare GPU machine lacks (TBB, OpenBLAS and its
# Fortran runtime, libstdc++). The CUDA image there has the driver and the CUDA libraries but
# none of ucp's Debian packages, and cannot download them, so building there is not an option.
# Then, on the device: tests/gpu/run_bundle.sh (carry .gpu_bundle).
# Usage: tests/gpu/bundle.sh [BUILD_DIR, default build]
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
targets=(offload_cuda_cast_test offload_cuda_ops_test offload_cuda_pipeline_test
         offload_cuda_model_test offload_cuda_adam_test offload_cuda_train_test
         offload_nccl_test offload_cuda_model_bench ucp_bench)
cmake --build "$build" -j2 --target "${targets[@]}"
out=.gpu_bundle
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
for t in "${targets[@]}"; do
  if [ "$t" = ucp_bench ]; then  # `ucp-bench train --device cuda` (the MFU figure)
    name=ucp-bench; f=$build/bin/ucp-bench
  else
    name=$t; f=$(find "$build/offload" -type f -name "$t" -perm -u+x | head -1)
  fi
  [ -n "$f" ] && [ -x "$f" ] || { echo "bundle: $t was not built" >&2; exit 1; }
  strip -o "$out/bin/$name" "$f"
  # Every library it links except glibc's own and CUDA's (the device image has both).
  ldd "$f" | awk '/=>/ {print $3}' | grep -v -E '/libc\.so|/libm\.so|/libdl\.so|/libpthread\.so|/librt\.so|/ld-linux|cuda|libcublas|libcudart' |
    while read -r lib; do cp -nL "$lib" "$out/lib/"; done
done
tar -C "$out" -czf "$out.tar.gz" bin lib
rm -rf "$out"
mkdir -p "$out"
mv "$out.tar.gz" "$out/bundle.tar.gz"
ls -la "$out"
echo "bundle: $(du -sh "$out" | cut -f1) in $out (ldd's libraries: $(tar -tzf "$out/bundle.tar.gz" | grep -c '^lib/.'))"
