#!/usr/bin/env bash
# Runs on the GPU machine what tests/gpu/bundle.sh packed: every gpu-labelled test (kernels, the
# device Adam, the CUDA trainer against the CPU engine and across checkpoints), then the model
# step against the CPU (small, loss checked), a larger LLaMA-style step (timing only), and
# `ucp-bench train --device cuda` at 16K tokens per step (MFU; optimizer offloaded vs on the GPU;
# then offloaded with --pipeline overlap).
# Writes each log under $OUT (the device tool brings them back). One call, about 4-5 minutes
# (estimated: none of it has run on a GPU yet).
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
# The trainer tests read the presets (patterns/) from the working tree carried here.
export UCP_DATA_DIR=$PWD
for t in offload_cuda_cast_test offload_cuda_ops_test offload_cuda_pipeline_test \
         offload_cuda_model_test offload_cuda_adam_test offload_cuda_train_test; do
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
# The training step of `ucp-train --device cuda` on a 1.1B LLaMA-style model at 4 x 4096 = 16K
# tokens: tokens/s, TFLOP/s and MFU (989 TFLOPS), then the same step with the whole optimizer on
# the GPU (the device Adam) and the ratio.
timeout 300 /tmp/ucp_gpu/bin/ucp-bench train --device cuda --model "$PWD/tests/gpu/llama-1b.json" \
  --seq-len 4096 --batch 4 --steps 2 --threads "$(nproc)" --gpu-optimizer 2>&1 |
  tee "$out/bench_train_1b.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
# The same step with --pipeline overlap: each bucket's gradient to the host and its CPU Adam
# during backward (the ratio to the line above is what the overlap hides).
timeout 300 /tmp/ucp_gpu/bin/ucp-bench train --device cuda --model "$PWD/tests/gpu/llama-1b.json" \
  --seq-len 4096 --batch 4 --steps 2 --threads "$(nproc)" --pipeline overlap 2>&1 |
  tee "$out/bench_train_1b_overlap.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
