#!/usr/bin/env bash
# ucp-train through the real binary: help and usage errors with their exit codes, then a run
# killed with SIGKILL at several moments (saving every step, so kills land inside saves too):
# after every kill each step_* checkpoint that exists is complete and verifies, and a resume
# finishes the run with every step logged exactly once; the resumed steps' losses equal those of
# an uninterrupted run bit for bit (same layout).
# Usage: train_cli_test.sh BIN_DIR WORK_DIR
set -euo pipefail
bin=$1
work=$2
train=$bin/ucp-train
ucp=$bin/ucp
rm -rf "$work"
mkdir -p "$work"
fail() { echo "FAIL: $*" >&2; exit 1; }
expect_exit() {  # expect_exit CODE CMD...
  local want=$1; shift
  set +e; "$@" > "$work/out.txt" 2> "$work/err.txt"; local got=$?; set -e
  [ "$got" = "$want" ] || { cat "$work/err.txt" >&2; fail "'$*' exited $got, expected $want"; }
}

# Help lists every option; usage errors exit 2; bad values 3; a missing model 4.
"$train" --help > "$work/help.txt"
for opt in --model --dtype --data --steps --save-every --keep --resume --init --out --layout \
           --global-batch --micro-batch --lr --clip-grad --seed --threads; do
  grep -q -- "$opt" "$work/help.txt" || fail "--help does not document $opt"
done
expect_exit 2 "$train" --steps 3
expect_exit 2 "$train" --out "$work/x" --no-such-option
expect_exit 2 "$train" --out "$work/x" --steps many
expect_exit 2 "$train" --resume "$work/a" --init "$work/b"
expect_exit 3 "$train" --out "$work/x" --global-batch 6 --micro-batch 4 --steps 1
grep -q "does not divide" "$work/err.txt" || fail "indivisible micro-batch message"
expect_exit 4 "$train" --out "$work/x" --model no-such-model --steps 1
expect_exit 4 "$train" --out "$work/x" --data "$work/missing.bin" --steps 1
expect_exit 7 "$train" --out "$work/x" --layout tp=2 --steps 1

# --plan prints the memory plan and exits, allocating nothing (no --out needed): GPT-2 small at
# 4 x 1024 tokens keeps its weights resident on an 8 GiB GPU, streams them per layer on 6900 MiB
# (which a run with --weights auto then does), does not fit on 6 GiB (2 GiB are reserved, and
# the CUDA model's classifier logits, bf16 GEMM inputs and attention passes take 1.6 GiB beyond
# the activations); bad sizes and layouts are refused.
plan() { expect_exit 0 "$train" --plan --model gpt2-small --seq-len 1024 --global-batch 8 \
           --micro-batch 4 --device-memory "$1" --out "$work/plan_run"; }
plan 8G; grep -q "fits with weights resident" "$work/out.txt" || fail "--plan 8G: $(cat "$work/out.txt")"
grep -q "^activations + scratch" "$work/out.txt" || fail "--plan lists no activations row"
grep -q "124475904 parameters" "$work/out.txt" || fail "--plan: parameter count"
plan 6900M; grep -q "streamed per layer.*what --weights auto picks" "$work/out.txt" ||
  fail "--plan 6900M: $(cat "$work/out.txt")"
plan 6G; grep -q "does not fit" "$work/out.txt" || fail "--plan 6G: $(cat "$work/out.txt")"
[ ! -e "$work/plan_run" ] || fail "--plan created its --out folder"
expect_exit 3 "$train" --plan --device-memory lots
grep -q -- "--device-memory" "$work/err.txt" || fail "--device-memory error names the option"
expect_exit 7 "$train" --plan --layout tp=2

# ucp-bench model: the model step's rate on the CPU (the GPU side runs in tests/gpu).
if [ -x "$bin/ucp-bench" ]; then
  expect_exit 0 "$bin/ucp-bench" model --model llama-tiny --seq-len 16 --batch 2 --steps 1
  grep -q "^cpu .*tokens/s .*MFU" "$work/out.txt" || fail "ucp-bench model: $(cat "$work/out.txt")"
  expect_exit 3 "$bin/ucp-bench" model --model llama-tiny --device tpu
  # ucp-bench train's device flow (what `--device cuda` prints on the H200: the device, the
  # overlapped step, the optimizer-on-the-device ratio) through the CPU twin.
  expect_exit 0 "$bin/ucp-bench" train --model llama-tiny --seq-len 16 --batch 2 --steps 1 \
    --device twin --pipeline overlap --gpu-optimizer --speculation always
  grep -q "^device twin" "$work/out.txt" || fail "ucp-bench train --device twin: $(cat "$work/out.txt")"
  grep -q "optimizer on the twin device .*offloaded step / GPU step = " "$work/out.txt" ||
    fail "ucp-bench train --gpu-optimizer on the twin: $(cat "$work/out.txt")"
  # Where the step's time went, for both runs, and how many timed steps were clipped.
  # The overlapped step's first forward waited for the warm-up step's finish (it ran under it).
  [ "$(grep -c "phases of the best step (ms): forward+backward+gradients to the host [0-9.]* | reduce+norm [0-9.]* | clip+AdamW+widen [0-9.]* | weights to the device [0-9.]*$" "$work/out.txt")" = 1 ] ||
    fail "ucp-bench train: the phase lines: $(cat "$work/out.txt")"
  grep -Eq "phases of the best step \(ms\): forward\+backward\+gradients to the host [0-9.]+ \([0-9.]+ waiting for the last step's finish\) \| reduce\+norm" "$work/out.txt" ||
    fail "ucp-bench train: the overlapped phase line: $(cat "$work/out.txt")"
  grep -q "clipped in [01] of 1 timed steps (--clip 1; a clipped step corrects every speculative bucket)" "$work/out.txt" ||
    fail "ucp-bench train: the clipped count: $(cat "$work/out.txt")"
  # What validation did: every bucket stepped during backward, then committed or corrected.
  grep -Eq "overlap of the best step: [1-9][0-9]* buckets stepped during backward, [0-9]+ committed, [0-9]+ corrected, 0 undone" "$work/out.txt" ||
    fail "ucp-bench train: the overlap line: $(cat "$work/out.txt")"
  # Without speculation every bucket is held for validation, none stepped during backward; so
  # with the default (auto) after a clipped step (--clip 1e-9: the warm-up step is clipped).
  for how in "--speculation off" "--clip 1e-9"; do
    # shellcheck disable=SC2086
    expect_exit 0 "$bin/ucp-bench" train --model llama-tiny --seq-len 16 --batch 2 --steps 1 \
      --device twin --pipeline overlap $how
    grep -Eq "overlap of the best step: 0 buckets stepped during backward, 0 committed, 0 corrected, 0 undone, 6 held for validation" "$work/out.txt" ||
      fail "ucp-bench train $how: $(cat "$work/out.txt")"
  done
  grep -q "(--clip 1e-09; a clipped step corrects every speculative bucket, and the step after it holds its buckets for validation)" "$work/out.txt" ||
    fail "ucp-bench train --clip 1e-9: the clipped line: $(cat "$work/out.txt")"
  # Some tail grad groups on the device Adam, overlapped (the step the GPU run times at 3B).
  expect_exit 0 "$bin/ucp-bench" train --model llama-tiny --seq-len 16 --batch 2 --steps 1 \
    --device twin --pipeline overlap --gpu-tail-buckets 2
  grep -Eq "^device twin.* [1-9][0-9]* parameters stepped by the device Adam" "$work/out.txt" ||
    fail "ucp-bench train --gpu-tail-buckets on the twin: $(cat "$work/out.txt")"
  # Streamed weights: the bytes crossing per step; an unknown placement is refused.
  expect_exit 0 "$bin/ucp-bench" train --model llama-tiny --seq-len 16 --batch 2 --steps 1 \
    --device twin --pipeline overlap --weights streamed
  grep -Eq "^weights streamed: [0-9.]+ MiB on the device, [0-9.]+ MiB crossing per step \([0-9.]+ B/parameter\)" "$work/out.txt" ||
    fail "ucp-bench train --weights streamed: $(cat "$work/out.txt")"
  expect_exit 3 "$bin/ucp-bench" train --model llama-tiny --seq-len 16 --batch 2 --steps 1 \
    --device twin --weights paged
  grep -q -- "--weights paged" "$work/err.txt" || fail "--weights paged: $(cat "$work/err.txt")"
  expect_exit 3 "$bin/ucp-bench" train --model llama-tiny --gpu-optimizer
  # --largest: the most layers of the model's layer whose plan fits the given memories (here the
  # device's 12 MiB beyond the 2 GiB reserve binds: one layer more does not fit), then a step of it.
  expect_exit 0 "$bin/ucp-bench" train --model llama-tiny --seq-len 16 --batch 2 --steps 1 \
    --device twin --largest --device-memory 2060M --host-memory 200M
  grep -Eq "^largest model for 2.01 GiB of device memory \(12.0 MiB usable\) and 200.0 MiB of host memory at 2 x 16 tokens per micro-batch: [0-9]+ layers of llama-tiny's layer \(4 in llama-tiny\), [0-9]+ parameters; planned device" "$work/out.txt" ||
    fail "ucp-bench train --largest: $(cat "$work/out.txt")"
  grep -q "^  one layer more: GPU: does not fit" "$work/out.txt" ||
    fail "ucp-bench train --largest: one layer more: $(cat "$work/out.txt")"
  layers=$(sed -n 's/^largest model .*: \([0-9]*\) layers of.*/\1/p' "$work/out.txt")
  grep -q "^model llama-tiny-${layers}l: " "$work/out.txt" ||
    fail "ucp-bench train --largest trained another model: $(cat "$work/out.txt")"
  # The host binds instead: fewer layers.
  expect_exit 0 "$bin/ucp-bench" train --model llama-tiny --seq-len 16 --batch 2 --steps 1 \
    --device twin --largest --device-memory 2060M --host-memory 30M
  host_layers=$(sed -n 's/^largest model .*: \([0-9]*\) layers of.*/\1/p' "$work/out.txt")
  [ "$host_layers" -lt "$layers" ] && grep -q "one layer more: .*host side does NOT fit" "$work/out.txt" ||
    fail "ucp-bench train --largest on 30M of host memory: $(cat "$work/out.txt")"
  expect_exit 3 "$bin/ucp-bench" train --model llama-tiny --largest
  grep -q -- "--largest needs --device" "$work/err.txt" || fail "--largest on the CPU: $(cat "$work/err.txt")"
  expect_exit 3 "$bin/ucp-bench" train --model llama-tiny --device twin --largest
  grep -q -- "--device-memory" "$work/err.txt" || fail "--largest on the twin: $(cat "$work/err.txt")"
  # Staged host buffers: the bytes through the windows a step, the gradients once (the twin sums
  # the norm where they are) and the weights back: 6 B/parameter.
  expect_exit 0 "$bin/ucp-bench" train --model llama-tiny --seq-len 16 --batch 2 --steps 1 \
    --device twin --host-buffers staged
  grep -Eq "^host buffers staged: [0-9.]+ MiB through the windows per step \(6.0 B/parameter\)" "$work/out.txt" ||
    fail "ucp-bench train --host-buffers staged: $(cat "$work/out.txt")"
  # More tokens per step through micro-batches (gradient accumulation).
  expect_exit 0 "$bin/ucp-bench" train --model llama-tiny --seq-len 16 --batch 4 --micro-batch 2 \
    --steps 1 --device twin
  grep -q "^schedule: .* of 4 samples (64 tokens) in micro-batches of 2" "$work/out.txt" ||
    fail "ucp-bench train --micro-batch: $(cat "$work/out.txt")"
  # Built with CUDA on a machine without a GPU (CI): --device cuda says so before the trainer
  # builds its host state (exit 10, device error).
  if [ -d "$bin/../offload/offload/cuda" ] && ! nvidia-smi -L >/dev/null 2>&1; then
    expect_exit 10 "$bin/ucp-bench" train --model llama-tiny --seq-len 16 --batch 2 --steps 1 \
      --device cuda
    grep -q "no CUDA device visible" "$work/err.txt" ||
      fail "ucp-bench --device cuda without a GPU: $(cat "$work/err.txt")"
  fi
fi

# A small text corpus; the uninterrupted reference run.
python3 - "$work/text.txt" <<'PY'
import sys
words = "the of and to in is was that for on with as by at from his her it be are this".split()
with open(sys.argv[1], "w") as f:
    for i in range(4000):
        f.write(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(9)) + ".\n")
PY
common=(--model gpt-tiny --data "$work/text.txt" --seq-len 32 --global-batch 8 --micro-batch 4
        --steps 40 --threads 2 --val-every 0 --quiet)
if [ -d "$bin/../offload/offload/cuda" ] && ! nvidia-smi -L >/dev/null 2>&1; then
  expect_exit 10 "$train" "${common[@]}" --device cuda --out "$work/nogpu"
  grep -q "no CUDA device visible" "$work/err.txt" ||
    fail "ucp-train --device cuda without a GPU: $(cat "$work/err.txt")"
fi
"$train" "${common[@]}" --out "$work/ref"
[ -f "$work/ref/step_00000040/ucp_layout.json" ] || fail "no final checkpoint"
expect_exit 11 "$train" "${common[@]}" --out "$work/ref"
expect_exit 3 "$train" --resume "$work/ref" --lr 0.5

# --weights streamed on the twin device (each layer crossing as the graph reaches it), and
# --host-buffers staged (the host keeping windows of the weights and gradients, not copies),
# train the CPU engine's bits: every logged loss and norm of 5 steps of 2 micro-batches.
for run in cpu streamed staged; do
  extra=()
  [ "$run" = streamed ] && extra=(--device twin --weights streamed --pipeline overlap)
  [ "$run" = staged ] && extra=(--device twin --host-buffers staged)
  "$train" --model gpt-tiny --data "$work/text.txt" --seq-len 32 --global-batch 8 --micro-batch 4 \
    --steps 5 --threads 2 --val-every 0 --sync-save "${extra[@]}" --out "$work/w_$run" > "$work/w_$run.txt"
done
grep -q "weights streamed" "$work/w_streamed.txt" || fail "--weights streamed: $(cat "$work/w_streamed.txt")"
python3 - "$work" <<'PY' || fail "--weights streamed: not the CPU engine's losses"
import json, os, sys
def steps(run):
    return [(j["loss"], j["grad_norm"]) for j in map(json.loads, open(os.path.join(sys.argv[1], run, "log.jsonl"))) if "grad_norm" in j]
a = steps("w_cpu")
for run in ("w_streamed", "w_staged"):
    b = steps(run)
    assert len(a) == 5 and a == b, (run, a, b)
PY
expect_exit 3 "$train" "${common[@]}" --device twin --weights paged --out "$work/paged"
expect_exit 3 "$train" "${common[@]}" --device twin --host-buffers none --out "$work/hb"
grep -q -- "--host-buffers none" "$work/err.txt" || fail "--host-buffers none: $(cat "$work/err.txt")"
expect_exit 7 "$train" "${common[@]}" --device twin --host-buffers staged --pipeline overlap \
  --out "$work/hb2"
grep -q -- "--pipeline sync" "$work/err.txt" || fail "staged with overlap: $(cat "$work/err.txt")"

# --init from a Hugging Face folder trains from exactly the weights of the checkpoint it was
# exported from (the same first-step loss as --init from that checkpoint).
"$ucp" generate --model llama-tiny --layout universal --dtype fp32 --seed 3 --out "$work/u" > /dev/null
"$ucp" convert "$work/u" "$work/hf" --format hf > /dev/null
for src in u hf; do
  "$train" --init "$work/$src" --data "$work/text.txt" --dtype fp32 --seq-len 32 --global-batch 4 \
    --steps 1 --threads 1 --quiet --out "$work/init_$src"
done
python3 - "$work" <<'PY'
import json, os, sys
def first(run):
    for line in open(os.path.join(sys.argv[1], run, "log.jsonl")):
        j = json.loads(line)
        if "loss" in j:
            return j["loss"]
a, b = first("init_u"), first("init_hf")
assert a == b, "--init from the HF export: loss %r, from the universal source %r" % (b, a)
print("train_cli_test: --init from a Hugging Face folder = --init from its source (loss %.6f)" % a)
PY
# A model whose q/k rows rotate in interleaved pairs (recorded by --rotary-layout) is refused:
# the engine rotates half-split pairs, and would train another model without a word.
"$ucp" convert "$work/hf" "$work/inter" --format ucp --layout tp=1 --rotary-layout interleaved \
  > /dev/null
expect_exit 7 "$train" --init "$work/inter" --data "$work/text.txt" --dtype fp32 --seq-len 32 \
  --global-batch 4 --steps 1 --threads 1 --quiet --out "$work/init_inter"
grep -q "rotate in interleaved pairs (rotary_interleaved = 1)" "$work/err.txt" ||
  fail "--init of an interleaved-rotary model: $(cat "$work/err.txt")"
[ ! -e "$work/init_inter" ] || fail "--init of an interleaved-rotary model left $work/init_inter"
echo "train_cli_test: --init of an interleaved-rotary model refused (exit 7)"

# Killed at several moments, resumed each time: twice deterministically (--kill-at: the process
# SIGKILLs itself right after a step's checkpoint), then at timed moments that may land inside a
# save (how many land depends on the machine's speed, so only the first two are counted on).
verify_all() {
  for d in "$work"/run/step_*; do
    case "$d" in *.tmp-*) continue ;; esac
    [ -d "$d" ] || continue
    "$ucp" verify "$d" > /dev/null || fail "$d does not verify after SIGKILL"
  done
}
set +e
"$train" "${common[@]}" --save-every 1 --keep 3 --out "$work/run" --kill-at 7
[ $? -eq 137 ] || fail "--kill-at 7 did not end the run with SIGKILL"
verify_all
"$train" --resume "$work/run" --quiet --kill-at 19
[ $? -eq 137 ] || fail "--kill-at 19 did not end the resumed run with SIGKILL"
set -e
verify_all
"$train" --resume "$work/run" --quiet &
pid=$!
for delay in 0.3 0.2 0.4; do
  sleep "$delay"
  kill -9 "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  verify_all
  "$train" --resume "$work/run" --quiet &
  pid=$!
done
wait "$pid"
[ -f "$work/run/step_00000040/ucp_layout.json" ] || fail "the resumed run did not finish"
ls -d "$work"/run/*.tmp-* 2>/dev/null && fail "temporary folders left behind"
# Every step logged exactly once, with the uninterrupted run's loss, bit for bit.
python3 - "$work/ref/log.jsonl" "$work/run/log.jsonl" <<'PY'
import json, sys
def steps(path):
    out = {}
    for line in open(path):
        j = json.loads(line)
        if "loss" in j:
            assert j["step"] not in out, "step %d logged twice in %s" % (j["step"], path)
            out[j["step"]] = j["loss"]
    return out
ref, run = steps(sys.argv[1]), steps(sys.argv[2])
resumes = sum(1 for line in open(sys.argv[2]) if '"event":"resume"' in line)
assert resumes >= 2, "only %d resumes: the --kill-at kills did not happen" % resumes
assert sorted(run) == list(range(1, 41)), sorted(run)
bad = [s for s in ref if ref[s] != run[s]]
assert not bad, "losses differ at steps %s" % bad
print("train_cli_test: 40 steps, %d resumes after SIGKILL," % resumes, " every loss bitwise equal to the uninterrupted run")
PY
"$ucp" diff "$work/ref/step_00000040" "$work/run/step_00000040" > /dev/null ||
  fail "final checkpoints differ"
echo "train_cli_test: ok"
