#!/usr/bin/env bash
# The one short script for a machine with a GPU: builds with CUDA (sm_90 by default) and runs the
# `gpu`-labelled tests — the casts bitwise against the host's; every model op (offload/cuda/
# cuda_ops.h) against the CPU reference twin within its stated tolerance; the pipeline's CUDA
# backend bitwise against the CPU twin; the CUDA model's loss and gradients against the CPU
# model; the device Adam bitwise against the CPU Adam; `--device cuda` training against the CPU
# engine and across checkpoints — then times the model step on both (ucp-bench model --device
# both) and the training step (ucp-bench train --device cuda, 16K tokens, MFU; the optimizer
# offloaded after backward, on the GPU, and offloaded with --pipeline overlap).
# Usage: tests/gpu/run_gpu_checks.sh [cuda arch, default 90]
set -euo pipefail
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DUCP_ENABLE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${1:-90}" >/dev/null
cmake --build build-gpu -j"$(nproc)" --target offload_cuda_cast_test offload_cuda_ops_test \
  offload_cuda_pipeline_test offload_cuda_model_test offload_cuda_adam_test \
  offload_cuda_train_test offload_nccl_test ucp_bench
ctest --test-dir build-gpu -L gpu --output-on-failure
# The model step on the GPU against the CPU in the same run (loss checked, TFLOP/s and MFU).
build-gpu/bin/ucp-bench model --model gpt2-small --seq-len 1024 --batch 4 --threads "$(nproc)" \
  --steps 3 --device both
# The training step at 4 x 4096 tokens on a 1.1B LLaMA-style model, optimizer offloaded, then on
# the GPU (the ratio).
build-gpu/bin/ucp-bench train --device cuda --model "$PWD/tests/gpu/llama-1b.json" --seq-len 4096 \
  --batch 4 --steps 2 --threads "$(nproc)" --gpu-optimizer
build-gpu/bin/ucp-bench train --device cuda --model "$PWD/tests/gpu/llama-1b.json" --seq-len 4096 \
  --batch 4 --steps 2 --threads "$(nproc)" --pipeline overlap
