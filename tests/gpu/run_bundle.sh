#!/usr/bin/env bash
# Runs on the GPU machine what tests/gpu/bundle.sh packed: every gpu-labelled test (kernels, the
# device Adam, the CUDA trainer against the CPU engine and across checkpoints), then the model
# step against the CPU (small, loss checked, fp32 and bf16 GEMMs), a larger LLaMA-style step
# (bf16 GEMMs and GEMM attention, timing only),
# `ucp-bench train --device cuda` at 16K tokens per step on a 1.1B model (MFU; optimizer offloaded
# vs on the GPU; then offloaded with --pipeline overlap) and, with the time left, a 3B model.
#
# The device lease is short (15 minutes, machine start included), so the whole run keeps to a
# budget (UCP_GPU_BUDGET_S, default 380 s): each step gets at most its own limit and never more
# than what is left, and a step that would start with under 15 s left is reported SKIP. The most
# telling checks go first. A summary goes to stdout and $OUT/summary.txt; every log, in
# $OUT/logs.tar.gz, and the benchmarks' logs also one by one (the tool brings back 8 files).
# Usage (device tool): run(command="bash tests/gpu/run_bundle.sh", carry=[".gpu_bundle"],
#                          timeout_s=420)
# A rerun of some steps only: UCP_GPU_ONLY="offload_cuda_train_test bench_train_1b" (step names
# as the summary prints them; the others are not run and not reported).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/gpu_out}
logs=/tmp/ucp_gpu/logs
mkdir -p "$out" "$logs"
tar -C /tmp/ucp_gpu -xzf .gpu_bundle/bundle.tar.gz || { echo "FAIL: no bundle"; exit 1; }
cuda_lib=$(ls -d /usr/local/cuda/lib64 /usr/local/cuda/lib 2>/dev/null | tr '\n' ':')
# The CUDA image's pip wheels (nvidia-cublas, ...) also hold the CUDA 13 libraries: a fallback.
wheel_libs=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/*/lib 2>/dev/null | tr '\n' ':')
export LD_LIBRARY_PATH=/tmp/ucp_gpu/lib:${cuda_lib}${wheel_libs}${LD_LIBRARY_PATH:-}
# NCCL (the trainer's device and offload_nccl_test link it; 200 MB, too large to carry): the
# image's own, wherever a package put it, when the paths above lack it.
have_nccl=0
ldconfig -p | grep -q 'libnccl\.so\.2' && have_nccl=1
IFS=: read -ra lib_dirs <<<"$LD_LIBRARY_PATH"
for d in "${lib_dirs[@]}"; do [ -n "$d" ] && [ -e "$d/libnccl.so.2" ] && have_nccl=1; done
if [ "$have_nccl" = 0 ]; then
  nccl=$(find / -xdev -name 'libnccl.so.2' -not -path '/proc/*' 2>/dev/null | head -1)
  [ -n "$nccl" ] && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$(dirname "$nccl")
fi
# The trainer tests read the presets (patterns/) from the working tree carried here.
export UCP_DATA_DIR=$PWD
start=$(date +%s)
budget=${UCP_GPU_BUDGET_S:-380}
status=0
summary=$logs/summary.txt
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }

have_gpu=0
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader) && have_gpu=1
say "gpu: $gpu"
say "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-) x $(nproc)"
# A library the image lacks shows here, before any step fails on it.
for b in /tmp/ucp_gpu/bin/*; do
  ldd "$b" | grep 'not found' | sed "s|^|  $(basename "$b"): |" | tee -a "$summary"
done

# wanted NAME: the step is to run (UCP_GPU_ONLY unset, or it names the step).
wanted() { [ -z "${UCP_GPU_ONLY:-}" ] || [[ " $UCP_GPU_ONLY " == *" $1 "* ]]; }

# step NAME MAX_SECONDS COMMAND...: runs COMMAND into $logs/NAME.log under the budget; a step
# UCP_GPU_ONLY leaves out returns 126 at once.
step_rc=0
step() {
  local name=$1 max=$2
  shift 2
  if ! wanted "$name"; then
    step_rc=126
    return
  fi
  local left=$((budget - ($(date +%s) - start) - 5))
  local t=$((max < left ? max : left))
  if [ "$t" -lt 15 ]; then
    say "SKIP $name: out of the run's budget"
    step_rc=125
    return
  fi
  local t0
  t0=$(date +%s)
  timeout -k 5 "$t" "$@" >"$logs/$name.log" 2>&1
  step_rc=$?
  local took=$(($(date +%s) - t0))
  if [ "$step_rc" = 124 ]; then
    say "TIMEOUT $name after ${took} s (limit $t s)"
  elif [ "$step_rc" = 137 ]; then
    say "KILLED $name after ${took} s (limit $t s; out of memory?)"
  elif [ "$step_rc" != 0 ]; then
    say "FAIL $name (exit $step_rc, ${took} s)"
  else
    say "ran $name in ${took} s"
  fi
}

for t in offload_cuda_cast_test offload_cuda_ops_test offload_cuda_adam_test offload_nccl_test \
         offload_cuda_pipeline_test offload_cuda_model_test offload_cuda_train_test; do
  step "$t" 90 /tmp/ucp_gpu/bin/$t
  if [ "$step_rc" = 126 ]; then
    continue
  elif [ "$step_rc" = 0 ]; then
    skipped=$(grep -c '^\[  SKIPPED \] .* ms)$' "$logs/$t.log")
    say "  $(grep -c '^\[       OK \]' "$logs/$t.log") ok, $skipped skipped"
    # With a GPU present nothing may skip: a skip would hide an unchecked kernel.
    if [ "$have_gpu" = 1 ] && [ "$skipped" != 0 ]; then say "  FAIL: skipped tests"; status=1; fi
  else
    status=1
    grep -E '^\[  FAILED  \]|Failure|error|Error' "$logs/$t.log" | head -12 | tee -a "$summary"
    tail -5 "$logs/$t.log" | tee -a "$summary"
  fi
done

bench=/tmp/ucp_gpu/bin/offload_cuda_model_bench
ok_or_fail() { [ "$step_rc" = 0 ] || [ "$step_rc" = 126 ] || status=1; }
show() { [ -f "$logs/$1.log" ] && grep -v '^\s*$' "$logs/$1.log" | tail -"${2:-12}" | tee -a "$summary"; }
# The model step against the CPU (each GEMM and attention mode), each also with every layer
# recomputed (--recompute both: the same gradient bits required, and the rerun's cost).
step bench_check 60 $bench --family llama --hidden 768 --layers 4 --heads 12 --kv-heads 4 \
  --ffn 2048 --vocab 32000 --batch 2 --seq 512 --steps 3 --cpu-check --attention both \
  --recompute both
ok_or_fail
show bench_check 20
# --profile: where the step's device time goes, op by op (the next MFU work starts from it),
# with the GEMM attention and with the flash kernels (the ratio of the two steps is printed).
step bench_1b 90 $bench --family llama --hidden 2048 --layers 16 --heads 16 --kv-heads 4 \
  --ffn 5632 --vocab 32000 --batch 4 --seq 4096 --steps 3 --gemm bf16 --attention both --profile
ok_or_fail
show bench_1b 70
# The training step of `ucp-train --device cuda` at 4 x 4096 = 16K tokens a step: tokens/s,
# TFLOP/s and MFU (989 TFLOPS).
train=(/tmp/ucp_gpu/bin/ucp-bench train --device cuda --seq-len 4096 --batch 4
       --threads "$(nproc)")
# The issue's MFU figure first (the budget may not reach the end): a 3B model with the optimizer
# offloaded, overlapped, the flash attention kernels, at 256K tokens per step (64 x 4096 in
# micro-batches of 4; LLaMA-class runs take 1-4M tokens a step), where the host's Adam (about
# 1 s at 3.2B on 16 cores) is a small part of the step; then at 64K tokens (16 x 4096), where it
# must hide under the last micro-batch's backward.
step bench_train_3b_256k_flash 150 "${train[@]:0:6}" --batch 64 --micro-batch 4 \
  --threads "$(nproc)" --model llama-3b --steps 1 --pipeline overlap --clip 0 --gpu-attention flash
show bench_train_3b_256k_flash 20
step bench_train_3b_64k_flash 120 "${train[@]:0:6}" --batch 16 --micro-batch 4 \
  --threads "$(nproc)" --model llama-3b --steps 1 --pipeline overlap --clip 0 --gpu-attention flash
show bench_train_3b_64k_flash 20
# The 64K tokens as one micro-batch, with the fewest layers recomputed in backward that fit the
# GPU (--recompute auto: 22 of 28 on a 140 GiB H200, 109 GiB of activations instead of 324):
# every bucket's CPU Adam can hide under the one backward, at the cost of a rerun forward of
# those layers (not in MFU).
step bench_train_3b_64k_flash_recompute 120 "${train[@]:0:6}" --batch 16 --micro-batch 16 \
  --threads "$(nproc)" --model llama-3b --steps 1 --pipeline overlap --clip 0 --gpu-attention flash \
  --recompute auto
show bench_train_3b_64k_flash_recompute 20
# The same with the grad groups backward finishes last on the device Adam (SuperOffload's
# tail), as many as the GPU's memory leaves room for (--gpu-tail-buckets auto; the log's
# description names the count): less CPU Adam left after the last micro-batch's backward.
step bench_train_3b_64k_flash_tail 120 "${train[@]:0:6}" --batch 16 --micro-batch 4 \
  --threads "$(nproc)" --model llama-3b --steps 1 --pipeline overlap --clip 0 --gpu-attention flash \
  --gpu-tail-buckets auto
show bench_train_3b_64k_flash_tail 20
# The issue's second figure at 3B: the offloaded, overlapped 64K-token step against the same
# step with the whole optimizer on the GPU (micro-batches of 2: the device-resident masters and
# Adam states, 12 B/parameter, need the activations' room).
step bench_train_3b_64k_ratio 150 "${train[@]:0:6}" --batch 16 --micro-batch 2 \
  --threads "$(nproc)" --model llama-3b --steps 1 --pipeline overlap --clip 0 --gpu-attention flash \
  --gpu-optimizer
show bench_train_3b_64k_ratio 20
# A 1.1B LLaMA-style model's synchronous step, then the same step with the whole optimizer on
# the GPU (the device Adam) and the ratio.
step bench_train_1b 100 "${train[@]}" --model "$PWD/tests/gpu/llama-1b.json" --steps 2 \
  --gpu-optimizer
ok_or_fail
show bench_train_1b 20
# The same synchronous step with the flash attention kernels (--gpu-attention flash).
step bench_train_1b_flash 60 "${train[@]}" --model "$PWD/tests/gpu/llama-1b.json" --steps 2 \
  --gpu-attention flash
ok_or_fail
show bench_train_1b_flash 12
# The same synchronous step with staged host buffers: the device sums the norm, then the
# gradients cross window by window under the CPU Adam and the weights return under the next
# window's (against the line above: whole copies, then Adam).
step bench_train_1b_staged 60 "${train[@]}" --model "$PWD/tests/gpu/llama-1b.json" --steps 2 \
  --host-buffers staged
ok_or_fail
show bench_train_1b_staged 12
# The same step with --pipeline overlap: each bucket's gradient to the host and its CPU Adam
# during backward (the ratio to the line above is what the overlap hides). At clip 1 every step
# of this random-token run is clipped, so with the default --speculation auto each step after
# the first holds its buckets for validation (their Adam under the next forward), where
# --speculation always steps them during backward and corrects every one after it (the worst
# case, the next line); --clip 0 times the common case, where validation commits.
step bench_train_1b_overlap 80 "${train[@]}" --model "$PWD/tests/gpu/llama-1b.json" --steps 2 \
  --pipeline overlap
ok_or_fail
show bench_train_1b_overlap 20
step bench_train_1b_overlap_always 80 "${train[@]}" --model "$PWD/tests/gpu/llama-1b.json" \
  --steps 2 --pipeline overlap --speculation always
ok_or_fail
show bench_train_1b_overlap_always 12
# The same clipped step finished before the next begins (--sync-finish): the line above runs the
# corrections and the weights' return under the next step's forward; the ratio is what that hides.
step bench_train_1b_overlap_syncfinish 80 "${train[@]}" --model "$PWD/tests/gpu/llama-1b.json" \
  --steps 2 --pipeline overlap --sync-finish
ok_or_fail
show bench_train_1b_overlap_syncfinish 20
step bench_train_1b_overlap_noclip 80 "${train[@]}" --model "$PWD/tests/gpu/llama-1b.json" \
  --steps 2 --pipeline overlap --clip 0
ok_or_fail
show bench_train_1b_overlap_noclip 20
# Where the CPU Adam runs: the lines above give it all cores but the launching and copying
# threads' two (the default beside a GPU); against them, the old split (half the cores, as
# beside a model computing on the CPU) and the default pinned one thread to a core
# (--pin-threads: the last cores, leaving the first two to the other threads).
step bench_train_1b_overlap_noclip_half 80 "${train[@]}" --model "$PWD/tests/gpu/llama-1b.json" \
  --steps 2 --pipeline overlap --clip 0 --adam-threads "$(($(nproc) / 2))"
ok_or_fail
show bench_train_1b_overlap_noclip_half 12
step bench_train_1b_overlap_noclip_pinned 80 "${train[@]}" --model "$PWD/tests/gpu/llama-1b.json" \
  --steps 2 --pipeline overlap --clip 0 --pin-threads
ok_or_fail
show bench_train_1b_overlap_noclip_pinned 12
# The CPU Adam alone on this host's cores, unpinned and pinned, beside its bandwidth probe.
step bench_adam_pin 60 /tmp/ucp_gpu/bin/ucp-bench adam --params 256M --threads "$(nproc)" \
  --pin --repeat 3
ok_or_fail
show bench_adam_pin 14
# The same step with the weights streamed per layer (--weights streamed: the embeddings, the head
# and two layer windows on the GPU, each layer prefetched on the copy stream): the ratio to the
# line above is streaming's cost; the bench prints the device memory and the bytes per step.
step bench_train_1b_streamed 80 "${train[@]}" --model "$PWD/tests/gpu/llama-1b.json" --steps 2 \
  --pipeline overlap --clip 0 --weights streamed
ok_or_fail
show bench_train_1b_streamed 20
# A 3B model (the llama-3b preset: Llama-3.2-3B's shape), with what time is left: sync, then
# overlapped without clipping.
step bench_train_3b 100 "${train[@]}" --model llama-3b --steps 1
show bench_train_3b 20
# The same clipped 3B step overlapped without speculation (no snapshots, the sync path's host
# memory): the gradients and the norm during backward, the Adam under the next forward.
step bench_train_3b_nospec 100 "${train[@]}" --model llama-3b --steps 1 --pipeline overlap \
  --speculation off
show bench_train_3b_nospec 20
step bench_train_3b_overlap_noclip 100 "${train[@]}" --model llama-3b --steps 1 \
  --pipeline overlap --clip 0
show bench_train_3b_overlap_noclip 20
# 64K tokens per step (16 x 4096 in micro-batches of 4): the host's Adam, about 1 s at 3.2B on
# 16 cores, is amortised over four times the GPU work.
step bench_train_3b_64k 120 "${train[@]:0:6}" --batch 16 --micro-batch 4 --threads "$(nproc)" \
  --model llama-3b --steps 1 --pipeline overlap --clip 0
show bench_train_3b_64k 20
# The largest model: the most layers of Llama-3-8B's layer (tests/gpu/llama-10b.json, 46 layers:
# 10.3B) that the memory plan fits on this GPU and in this host's available memory at 4 x 4096
# tokens in micro-batches of 1 (`ucp-bench train --largest`: host buffers staged where whole ones
# do not fit, the compute copy packed), then one step of it.
step bench_train_largest 240 "${train[@]:0:4}" --seq-len 4096 --batch 4 --micro-batch 1 \
  --threads "$(nproc)" --model "$PWD/tests/gpu/llama-10b.json" --steps 1 --largest
show bench_train_largest 20
nvidia-smi --query-gpu=memory.used,temperature.gpu,clocks.sm --format=csv >>"$logs/gpu_after.log" 2>&1

cp "$summary" "$out/summary.txt"
# The training benchmarks' logs one by one (with the summary and the archive: the 8 files
# the tool brings back); the model benchmarks' are in the archive.
for f in bench_train_3b_256k_flash bench_train_3b_64k_flash bench_train_3b_64k_flash_recompute \
         bench_train_1b bench_train_1b_flash bench_train_largest; do
  [ -f "$logs/$f.log" ] && cp "$logs/$f.log" "$out/"
done
tar -C "$logs" -czf "$out/logs.tar.gz" .
say "status $status after $(($(date +%s) - start)) s"
exit $status
