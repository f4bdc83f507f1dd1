#!/usr/bin/env bash
# Runs on the GPU machine what tests/gpu/bundle.sh packed: every gpu-labelled test, then the
# model step against the CPU (small, loss checked) and a larger LLaMA-style step (timing only).
# Writes each log under $OUT (the device tool brings them back). One call, about 3 minutes.
# Usage (device tool): run(command="bash tests/gpu/run_bundle.sh", carry=[".gpu_bundle"])
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/gpu_out}
mkdir -p "$out" /tmp/ucp_gpu
tar -C /tmp/ucp_gpu -xzf .gpu_bundle/bundle.tar.gz
cuda_lib=$(ls -d /usr/local/cuda/lib64 /usr/local/cuda/lib 2>/dev/null | tr '\n' ':')
export LD_LIBRARY_PATH=/tmp/ucp_gpu/lib:${cuda_lib}${LD_LIBRARY_PATH:-}
have_gpu=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt" &&
  have_gpu=1
grep -m1 "model name" /proc/cpuinfo | tee -a "$out/gpu.txt"
status=0
for t in offload_cuda_cast_test offload_cuda_ops_test offload_cuda_pipeline_test \
         offload_cuda_model_test; do
  if timeout 300 /tmp/ucp_gpu/bin/$t > "$out/$t.log" 2>&1; then
    skipped=$(grep -c '^\[  SKIPPED \] .* ms)$' "$out/$t.log")
    echo "PASS $t: $(grep -c '^\[       OK \]' "$out/$t.log") ok, $skipped skipped"
    # With a GPU present nothing may skip: a skip would hide an unchecked kernel.
    if [ "$have_gpu" = 1 ] && [ "$skipped" != 0 ]; then echo "FAIL $t skipped tests"; status=1; fi
  else
    echo "FAIL $t"; tail -30 "$out/$t.log"; status=1
  fi
done
bench=/tmp/ucp_gpu/bin/offload_cuda_model_bench
timeout 300 $bench --family llama --hidden 768 --layers 4 --heads 12 --kv-heads 4 --ffn 2048 \
  --vocab 32000 --batch 2 --seq 512 --steps 3 --cpu-check 2>&1 | tee "$out/bench_check.log" || status=1
timeout 300 $bench --family llama --hidden 2048 --layers 16 --heads 16 --kv-heads 4 --ffn 5632 \
  --vocab 32000 --batch 4 --seq 4096 --steps 3 2>&1 | tee "$out/bench_1b.log" || status=1
exit $status
