#!/usr/bin/env bash
# One peer test (docs/peers.md): the real DeepSpeed, from the venv of tools/setup_peers.sh, against
# the ucp CLI. Usage: peer_test.sh CASE SRC_ROOT BIN_DIR WORK [ZERO]
#   train Z                 DeepSpeed trains a tiny GPT at dp=2, ZeRO-Z, on CPU and checkpoints at
#                           step 4 of 8 (WORK/zeroZ: the fixture of the cases below); Z is 1, 2,
#                           3, or 3sg: ZeRO-3 with sub_group_size 1000 (several sub-groups)
#   ucp-reads-deepspeed Z   ucp extract of that checkpoint == ds_to_universal == zero_to_fp32,
#                           and ucp reads ds_to_universal's folder back equal to its extraction
#                           (ZeRO-3: == zero_to_fp32 == the engine's state; 0.14.4's
#                           ds_to_universal has no ZeRO-3 path: ds-to-universal-zero3 below)
#   deepspeed-reads-ucp Z   ucp extract, then ucp reshard --format deepspeed-universal; DeepSpeed
#                           loads it at dp=1 and at dp=2 and continues the run
#   deepspeed-control Z     the same resumes without ucp: DeepSpeed's own ZeRO files at dp=2, its
#                           own ds_to_universal output at dp=1 (if these fail, the harness or
#                           DeepSpeed is at fault, not ucp)
#   deepspeed-loads-ucp Z   ucp convert --format deepspeed to dp=1 (same ZeRO stage), then of that
#                           to dp=2 at the other stage, and ucp reshard --format deepspeed of the
#                           extraction to dp=2: DeepSpeed's plain load_checkpoint loads each and
#                           continues the run
#   deepspeed-loads-ucp-zero3 3|3sg  ucp convert --format deepspeed of the ZeRO-3 run (dp=2) to
#                           tp=1,pp=1,dp=1,zero=3; a ZeRO-3 engine at dp=1 (default sub_group_size)
#                           loads it and continues the run. (DeepSpeed 0.14.4 resuming its own
#                           ZeRO-3 checkpoint at dp=2 on this CPU/gloo harness diverges at the first
#                           step, so dp=2 loads are not a usable check; docs/peers.md.)
#   ds-to-universal-reads-ucp 1  DeepSpeed's ds_to_universal on GPTModelPipe, GPTModel and plain
#                           checkpoints ucp wrote == ucp's universal source, in Python and as
#                           ucp reads the universal folder back (ucp diff)
#   sgd Z                   its own run (WORK/sgd-zeroZ) with a client torch SGD with momentum:
#                           ucp extract == the engine's state (momentum_buffer under its name),
#                           and DeepSpeed loads ucp's --format deepspeed output (dp=1 zero=1, and
#                           from the extraction at dp=2) and continues the run
#   deepspeed-universal-llama  ucp's --format deepspeed-universal of a generated llama-tiny (GQA,
#                           SwiGLU): DeepSpeed's universal loader cuts from it, bitwise, the tp=2
#                           and tp=8 slices ucp's --format deepspeed holds; ds_to_universal on the
#                           tp=2 files writes the same folder; ucp reads it back equal; the
#                           same for a fuse of unequal parts (a SubparamShape) at tp=2; and
#                           ds_to_universal on Megatron tp=2 fixtures writes ucp's folder
#   deepspeed-reads-fixtures  DeepSpeed's ds_to_universal on tests/data/deepspeed == expected.pt
#   ds-to-universal-zero3 3|3sg|fixture  a current DeepSpeed's ds_to_universal (the second venv,
#                           tools/peer-dsu-requirements.txt) on the ZeRO-3 run's checkpoint, or on
#                           the ZeRO-3 fixture megatron_llama_zero3_tp2_dp3_bf16 (tp=2), == ucp
#                           extract of it, bitwise, and == the run's truth / the fixture's
#                           expected_llama.pt; and ucp diff reads the converter's folder back
#                           equal to its extraction
#   pipe-uneven             the real PipelineEngine at pp=2 with 2 + 1 layers (partition_method
#                           uniform): ucp extract == the engine's state; ucp's --format deepspeed
#                           of it loads into a fresh engine, state bitwise, the same losses
set -euo pipefail
test_case=$1 src=$2 bin=$3 work=$4 zero=${5:-}
venv=${UCP_PEER_VENV:-$HOME/.cache/ucp/peer-venv}
if [ ! -x "$venv/bin/python" ]; then
  echo "peer: no DeepSpeed venv at $venv: run tools/setup_peers.sh (it needs PyPI)" >&2
  exit 1
fi
py() { "$venv/bin/python" "$src/tests/peer/ds_peer.py" "$@"; }
run=$work/zero$zero
tag() { echo "$run/ckpt/$(cat "$run/ckpt/latest")"; }

case $test_case in
  train)
    if [ "$zero" = 3sg ]; then
      py train --work "$run" --zero 3 --sub-group-size 1000
    else
      py train --work "$run" --zero "$zero"
    fi
    ;;
  ucp-reads-deepspeed)
    out=$run/ucp-reads-deepspeed
    rm -rf "$out" && mkdir -p "$out"
    "$bin/ucp" extract "$(tag)" "$out/universal" --model "$src/tests/peer/gpt-peer.json"
    py extract --work "$run" --ucp "$out/universal" --out "$out/ds"
    # ucp reads DeepSpeed's own universal output (ds_to_universal on the same checkpoint): bitwise
    # what it extracted (plain DeepSpeed records no model: --model).
    # 0.14.4's ds_to_universal has no ZeRO-3 path: ds-to-universal-zero3 reads a current one's.
    if [ "$zero" = 1 ] || [ "$zero" = 2 ]; then
      py ds-universal --work "$run" --out "$out/dsu"
      "$bin/ucp" diff "$out/dsu/$(cat "$out/dsu/latest_universal")" "$out/universal" \
        --model "$src/tests/peer/gpt-peer.json"
    fi
    ;;
  deepspeed-reads-ucp)
    out=$run/deepspeed-reads-ucp
    rm -rf "$out" && mkdir -p "$out"
    "$bin/ucp" extract "$(tag)" "$out/universal" --model "$src/tests/peer/gpt-peer.json"
    # A tag in the root $out/dsu, named as ds_to_universal names its output
    # (global_step<N>_universal), and the root's latest_universal naming it: --into-root.
    mkdir -p "$out/dsu"
    "$bin/ucp" reshard "$out/universal" "$out/dsu" --into-root \
      --layout tp=1,pp=1,dp=1 --format deepspeed-universal --model-states-from "$(tag)"
    status=0  # both sizes, so one failure does not hide the other's result
    for dp in 1 2; do
      py resume --work "$run" --load "$out/dsu" --dp "$dp" --mode universal \
        --ucp "$out/universal" || status=1
    done
    exit $status
    ;;
  deepspeed-control)
    out=$run/deepspeed-control
    rm -rf "$out" && mkdir -p "$out"
    py resume --work "$run" --load "$run/ckpt" --dp 2 --mode zero
    py ds-universal --work "$run" --out "$out/dsu"
    py resume --work "$run" --load "$out/dsu" --dp 1 --mode universal
    ;;
  deepspeed-loads-ucp)
    out=$run/deepspeed-loads-ucp
    rm -rf "$out" && mkdir -p "$out"
    other=$((3 - zero))
    "$bin/ucp" convert "$(tag)" "$out/dp1" --layout "tp=1,pp=1,dp=1,zero=$zero" --format deepspeed \
      --model "$src/tests/peer/gpt-peer.json"
    # From ucp's own DeepSpeed output: its recorded model, naming and client state carry on.
    "$bin/ucp" convert "$out/dp1" "$out/dp2" --layout "tp=1,pp=1,dp=2,zero=$other" --format deepspeed
    # From a universal extraction: the client state its JSON kept (scheduler, param groups, ...).
    "$bin/ucp" extract "$(tag)" "$out/universal" --model "$src/tests/peer/gpt-peer.json"
    "$bin/ucp" reshard "$out/universal" "$out/from-universal" --layout "tp=1,pp=1,dp=2,zero=$zero" \
      --format deepspeed
    status=0  # every load, so one failure does not hide another's result
    py resume --work "$run" --load "$out/dp1" --dp 1 --mode zero || status=1
    py resume --work "$run" --load "$out/dp2" --dp 2 --mode zero --zero "$other" || status=1
    py resume --work "$run" --load "$out/from-universal" --dp 2 --mode zero || status=1
    exit $status
    ;;
  sgd)
    # A client torch.optim.SGD with momentum (state momentum_buffer, no step): the engine's
    # checkpoint read bitwise, and ucp's conversions (at dp=1 zero=1, and from the universal
    # extraction at dp=2) loaded by the engine with the same state, continuing the run.
    export UCP_PEER_OPTIMIZER=sgd
    run=$work/sgd-zero$zero
    py train --work "$run" --zero "$zero"
    out=$run/sgd
    rm -rf "$out" && mkdir -p "$out"
    "$bin/ucp" extract "$(tag)" "$out/universal" --model "$src/tests/peer/gpt-peer.json"
    py extract --work "$run" --ucp "$out/universal" --out "$out/ds"
    "$bin/ucp" convert "$(tag)" "$out/dp1" --layout tp=1,pp=1,dp=1,zero=1 --format deepspeed \
      --model "$src/tests/peer/gpt-peer.json"
    "$bin/ucp" reshard "$out/universal" "$out/from-universal" --layout tp=1,pp=1,dp=2,zero=2 \
      --format deepspeed
    status=0
    py resume --work "$run" --load "$out/dp1" --dp 1 --mode zero --zero 1 || status=1
    py resume --work "$run" --load "$out/from-universal" --dp 2 --mode zero || status=1
    exit $status
    ;;
  deepspeed-loads-ucp-zero3)
    out=$run/deepspeed-loads-ucp-zero3
    rm -rf "$out" && mkdir -p "$out"
    "$bin/ucp" convert "$(tag)" "$out/dp1" --layout tp=1,pp=1,dp=1,zero=3 --format deepspeed \
      --model "$src/tests/peer/gpt-peer.json"
    py resume --work "$run" --load "$out/dp1" --dp 1 --mode zero --zero 3
    ;;
  ds-to-universal-reads-ucp)
    out=$run/ds-to-universal-reads-ucp
    rm -rf "$out" && mkdir -p "$out"
    # The trained run's state under Megatron's names, and generated LLaMA / Mixtral checkpoints.
    peer_model=(--model "$src/tests/peer/gpt-peer.json")
    "$bin/ucp" extract "$(tag)" "$out/peer.u" "${peer_model[@]}"
    for m in llama-tiny mixtral-tiny; do
      "$bin/ucp" generate --model "$m" --layout tp=1,pp=1,dp=1 --seed 5 --out "$out/$m" >/dev/null
      "$bin/ucp" extract "$out/$m" "$out/$m.u" >/dev/null
    done
    status=0
    convert_and_read() {  # NAME SOURCE UNIVERSAL LAYOUT NAMING OPTIMIZER [--model M]
      local name=$1 from=$2 uni=$3 layout=$4 naming=$5 optimizer=$6
      shift 6
      "$bin/ucp" convert "$from" "$out/$name" --layout "$layout" --format deepspeed \
        --naming "$naming" --optimizer "$optimizer" "$@"
      py reads-ucp --tag "$out/$name/$(cat "$out/$name/latest")" --ucp "$uni" \
        --out "$out/$name.dtu" || status=1
      # ucp reads ds_to_universal's output back (the model ucp recorded in the model states it
      # copies): bitwise the universal checkpoint the DeepSpeed one was written from.
      "$bin/ucp" diff "$out/$name.dtu/universal" "$uni" || status=1
    }
    convert_and_read gpt-pipe "$(tag)" "$out/peer.u" tp=2,pp=2,dp=2,zero=1 megatron-pipe zero \
      "${peer_model[@]}"
    convert_and_read gpt-model "$(tag)" "$out/peer.u" tp=2,pp=1,dp=2,zero=2 megatron-gpt zero \
      "${peer_model[@]}"
    convert_and_read llama-pipe "$out/llama-tiny" "$out/llama-tiny.u" tp=2,pp=2,dp=3,zero=1 \
      megatron-pipe bf16
    convert_and_read mixtral-plain "$out/mixtral-tiny" "$out/mixtral-tiny.u" \
      tp=2,pp=1,dp=2,sp=2,zero=2 plain zero
    exit $status
    ;;
  deepspeed-universal-llama)
    # A LLaMA-style model (GQA: 8 heads, 4 query groups; SwiGLU) through --format
    # deepspeed-universal: DeepSpeed's own universal loader (load_hp_checkpoint_state) cuts from it
    # the slices ucp's --format deepspeed holds at tp=2 (Megatron-DeepSpeed's GPTModelPipe names;
    # ds_to_universal on those files writes the same folder) and at tp=8 (above the KV heads:
    # Megatron-Core's split inside a query group, plain names), and ucp reads it back bitwise.
    out=$work/deepspeed-universal-llama
    rm -rf "$out" && mkdir -p "$out"
    "$bin/ucp" generate --model llama-tiny --layout tp=1,pp=1,dp=1 --seed 7 --out "$out/g" \
      >/dev/null
    "$bin/ucp" extract "$out/g" "$out/g.u" >/dev/null
    "$bin/ucp" reshard "$out/g.u" "$out/dsu" --layout tp=2,pp=1 --format deepspeed-universal \
      >/dev/null
    status=0
    "$bin/ucp" reshard "$out/g.u" "$out/ds2" --layout tp=2,pp=1,dp=1,zero=1 --format deepspeed \
      --naming megatron-pipe --optimizer zero >/dev/null
    py universal-loader --dsu "$out/dsu" --tag "$out/ds2/$(cat "$out/ds2/latest")" \
      --ucp "$out/g.u" --out "$out/w2" --ds-to-universal --expect-key param_n_sub_params \
      || status=1
    "$bin/ucp" reshard "$out/g.u" "$out/ds8" --layout tp=8,pp=1,dp=1,zero=1 --format deepspeed \
      --naming plain --optimizer zero >/dev/null
    py universal-loader --dsu "$out/dsu" --tag "$out/ds8/$(cat "$out/ds8/latest")" \
      --ucp "$out/g.u" --out "$out/w8" || status=1
    "$bin/ucp" diff "$out/dsu" "$out/g.u" || status=1
    # ucp's own format cut from the DeepSpeed universal folder holds what --format deepspeed does.
    "$bin/ucp" convert "$out/dsu" "$out/u2" --format ucp --layout tp=2,pp=1,dp=1 >/dev/null
    "$bin/ucp" diff "$out/u2" "$out/ds2/$(cat "$out/ds2/latest")" || status=1
    # Megatron-DeepSpeed fixtures saved at tp=2 (LLaMA as GPTModelPipe, GPTModel flat and nested;
    # GPT): ucp's folder from their extraction is the one ds_to_universal writes from them. (A
    # tp=1 source saves no row-parallel list, so there ds_to_universal's cat_dim is 0 where ucp's
    # rules say 1: shared/reference/deepspeed_ucp.md 9.)
    for fx in megatron_llama_tp2_pp2_dp2_bf16 megatron_llama_tp2_pp1_dp2_fp16_zero1 \
      megatron_llama_nested_tp2_pp1_dp2_fp16_zero1 megatron_tp2_pp2_sp2_fp16_zero1; do
      f=$src/tests/data/deepspeed/$fx
      t=$f/$(cat "$f/latest")
      "$bin/ucp" extract "$f" "$out/$fx.u" >/dev/null
      "$bin/ucp" reshard "$out/$fx.u" "$out/$fx.dsu" --layout tp=2,pp=1 \
        --format deepspeed-universal --model-states-from "$t" >/dev/null
      py same-as-dtu --dsu "$out/$fx.dsu" --tag "$t" --ucp "$out/$fx.u" --out "$out/$fx.dtu" \
        || status=1
    done
    # A fuse of unequal parts (the QKV as plain [Q | K | V] under GQA: 64, 32, 32 rows; a rule set
    # made here from llama.json) goes out as a SubparamShape, which the loader cuts part by part;
    # the same rule set's norms are `average` rules, written whole as replicated ones.
    data=$out/data
    mkdir -p "$data/patterns/models"
    "$venv/bin/python" - "$src/patterns" "$data/patterns" <<'PY'
import json, sys
src, dst = sys.argv[1], sys.argv[2]
r = json.load(open(f"{src}/llama.json"))
r["family"] = "llamacat"
for rule in r["rules"]:
    if rule["kind"] == "replicate":  # the norms: average (the loader copies the whole tensor)
        rule["kind"] = "average"
    if "query_key_value" in rule["match"]:
        for k in ("groups", "group_name", "split_groups_up_to"):
            rule.pop(k, None)
        rule["order"] = "concat"
        rule["parts"] = [{"name": "q", "size": "heads*head_dim"},
                         {"name": "k", "size": "kv_heads*head_dim"},
                         {"name": "v", "size": "kv_heads*head_dim"}]
json.dump(r, open(f"{dst}/llamacat.json", "w"))
m = json.load(open(f"{src}/models/llama-tiny.json"))
m["name"], m["family"] = "llamacat-tiny", "llamacat"
json.dump(m, open(f"{dst}/models/llamacat-tiny.json", "w"))
PY
    (
      export UCP_DATA_DIR=$data
      "$bin/ucp" generate --model llamacat-tiny --layout tp=1,pp=1,dp=1 --seed 7 --out "$out/c" \
        >/dev/null
      "$bin/ucp" extract "$out/c" "$out/c.u" >/dev/null
      "$bin/ucp" reshard "$out/c.u" "$out/c.dsu" --layout tp=2,pp=1 \
        --format deepspeed-universal >/dev/null
      "$bin/ucp" reshard "$out/c.u" "$out/c.ds2" --layout tp=2,pp=1,dp=1,zero=1 \
        --format deepspeed --naming plain --optimizer zero >/dev/null
      py universal-loader --dsu "$out/c.dsu" --tag "$out/c.ds2/$(cat "$out/c.ds2/latest")" \
        --ucp "$out/c.u" --out "$out/wc" --expect-key sub_param_shape
      "$bin/ucp" diff "$out/c.dsu" "$out/c.u"
    ) || status=1
    exit $status
    ;;
  pipe-uneven)
    # Uneven pipeline stages (issue 14): the real PipelineEngine (GPTModelPipe's spec layout,
    # partition_method='uniform': 2 + 1 layers over pp=2) writes; ucp reads it bitwise and
    # writes it back with --format deepspeed, which a fresh engine loads and trains on.
    pipe() { "$venv/bin/python" "$src/tests/peer/ds_pipe_peer.py" "$@"; }
    w=$work/pipe-uneven
    pipe train --work "$w"
    t=$w/ckpt/$(cat "$w/ckpt/latest")
    m=(--model "$src/tests/peer/gpt-pipe-peer.json")
    "$bin/ucp" inspect "$t" "${m[@]}" | grep "^layout: .*stages=2+1$"
    rm -rf "$w/u" "$w/ds"
    "$bin/ucp" extract "$t" "$w/u" "${m[@]}"
    pipe check --work "$w" --ucp "$w/u"
    "$bin/ucp" convert "$t" "$w/ds" --format deepspeed "${m[@]}"
    "$bin/ucp" inspect "$w/ds" | grep "^layout: .*stages=2+1$"
    pipe resume --work "$w" --load "$w/ds"
    ;;
  ds-to-universal-zero3)
    # 0.14.4's converter has no ZeRO-3 path (0.14.5's PR #5475 added it) and a current DeepSpeed's
    # engine needs torch >= 2: the converter runs from a venv of its own (tools/setup_peers.sh).
    dsu_venv=${UCP_PEER_DSU_VENV:-$HOME/.cache/ucp/peer-venv-dsu}
    if [ ! -x "$dsu_venv/bin/python" ]; then
      echo "peer: no current-DeepSpeed venv at $dsu_venv: run tools/setup_peers.sh" \
           "(it needs PyPI)" >&2
      exit 1
    fi
    dtu() { "$dsu_venv/bin/python" "$src/tests/peer/ds_peer.py" dtu-vs-ucp "$@"; }
    if [ "$zero" = fixture ]; then
      f=$src/tests/data/deepspeed/megatron_llama_zero3_tp2_dp3_bf16
      out=$work/ds-to-universal-zero3-fixture
      rm -rf "$out" && mkdir -p "$out"
      "$bin/ucp" extract "$f" "$out/universal"
      dtu --tag "$f/$(cat "$f/latest")" --ucp "$out/universal" --out "$out/dsu" \
        --truth "$src/tests/data/deepspeed/expected_llama.pt"
      # The converter's folder holds no ucp_model and Megatron's GPTModel names fit the gpt and
      # llama rule sets alike: the family is named (the sizes come from its args and shapes).
      model=(--model llama)
    else
      out=$run/ds-to-universal-zero3
      rm -rf "$out" && mkdir -p "$out"
      "$bin/ucp" extract "$(tag)" "$out/universal" --model "$src/tests/peer/gpt-peer.json"
      dtu --tag "$(tag)" --ucp "$out/universal" --out "$out/dsu" --truth "$run/truth.pt"
      model=(--model "$src/tests/peer/gpt-peer.json")
    fi
    # ucp reads the converter's ZeRO-3 folder itself (zero_pp_rank_* model states, at tp=1 flat
    # state files shaped by their param_shapes): equal to its own extraction, every state.
    dsu=$out/dsu/$(cat "$out/dsu/latest_universal")
    "$bin/ucp" diff "$dsu" "$out/universal" "${model[@]}" | tee "$out/diff.txt"
    grep -q "^equal: " "$out/diff.txt"
    # and its step (from the Adam state of its zero/optimizer_state.pt) is the extraction's
    step=$("$dsu_venv/bin/python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["step"])' \
      "$out/universal/manifest.json")
    "$bin/ucp" inspect "$dsu" "${model[@]}" | grep "^step: *$step\$"
    ;;
  deepspeed-reads-fixtures)
    py fixtures --data "$src/tests/data/deepspeed"
    ;;
  *)
    echo "peer_test.sh: unknown case $test_case" >&2
    exit 2
    ;;
esac
