#!/usr/bin/python3
"""Checks with real torch a DeepSpeed ZeRO checkpoint that ucp wrote (--format deepspeed).

    ds_writer_check.py SAVE_DIR UNIVERSAL STANDINS

SAVE_DIR is what ucp wrote (SAVE_DIR/latest names the tag folder); UNIVERSAL is a ucp universal
checkpoint of the same model (the source's extraction); STANDINS is tools/fixture_standins.py,
whose stand-ins for DeepSpeed's classes let torch.load unpickle the files without DeepSpeed.

Independently of ucp's reader, from DeepSpeed's own conventions (deepspeed_ucp.md 2-4):
  * every file loads; mp_rank files have DeepSpeed's engine keys in its order, param_shapes as
    OrderedDicts of torch.Size, dp_world_size = dp*sp, mp_world_size = tp*pp, module an OrderedDict
    (or None with layer_IDX-model_TT files for GPTModelPipe);
  * optim files have exactly the keys of DeepSpeedZeroOptimizer.state_dict() (or BF16_Optimizer's),
    ZeroStageEnum / LossScaler / fragment_address objects, Adam state at full partition length,
    the fp32 partition trimmed of its padding (ZeRO) or whole (BF16), group_paddings on the last
    partition only, partition_count = dp*sp, param groups with 'params' [g];
  * each parameter's fragments, concatenated over the partitions in dp order, have the element
    count of its param_shapes entry, and the alignment padding is zero;
  * at tp=1 every fp32 / exp_avg / exp_avg_sq / module weight equals UNIVERSAL's, bit for bit
    (vocabulary padding rows zero), and GPTModelPipe's copies of the tied embedding module on the
    last stage equal stage 0's.
Prints "ok ..." and exits 0, or names every mismatch and exits 1.
"""

import collections
import importlib.util
import json
import os
import re
import sys

import h5py
import numpy as np
import torch

ENGINE_KEYS = ["module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
               "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler",
               "random_ltd", "sparse_tensor_module_names", "skipped_steps", "global_steps"]
ZERO_KEYS = ["loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "base_optimizer_state",
             "single_partition_of_fp32_groups", "zero_stage", "group_paddings", "partition_count",
             "ds_version", "param_slice_mappings"]
BF16_KEYS = ["clip_grad", "base_optimizer_state", "single_partition_of_fp32_groups",
             "group_paddings", "partition_count", "ds_version", "param_slice_mappings"]
STATES = ("fp32", "exp_avg", "exp_avg_sq")

problems = []


def fail(msg):
    problems.append(msg)


def canonical(name, layers):
    """GPTModelPipe / GPTModel / plain engine names -> ucp's canonical names."""
    m = re.fullmatch(r"tied_modules\.embed\.(.+)", name)
    if m:
        return "embedding." + m.group(1)
    m = re.fullmatch(r"1\.((word|position)_embeddings\..+)", name)
    if m:
        return "embedding." + m.group(1)
    m = re.fullmatch(r"(\d+)\.lm_head\.(.+)", name)
    if m:
        return "output_layer." + m.group(2)
    m = re.fullmatch(r"(\d+)\.(.+)", name)
    if m:
        idx, rest = int(m.group(1)), m.group(2)
        if idx == layers + 2:
            return "final_layernorm." + rest
        return f"layers.{idx - 2}.{rest}"
    for prefix in ("language_model.encoder.", "language_model."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def raw(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def main():
    save_dir, universal, standins = sys.argv[1:4]
    spec = importlib.util.spec_from_file_location("fixture_standins", standins)
    standin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standin)

    with open(os.path.join(save_dir, "latest")) as f:
        tag = os.path.join(save_dir, f.read().strip())
    manifest = json.load(open(os.path.join(universal, "manifest.json")))
    uni = {p["name"]: p for p in manifest["params"]}
    layers = 1 + max([int(n.split(".")[1]) for n in uni if n.startswith("layers.")] + [-1])

    def uni_state(name, state):
        with h5py.File(os.path.join(universal, uni[name]["file"]), "r") as h:
            return h[state][()]

    mp_files = sorted(f for f in os.listdir(tag) if re.fullmatch(r"mp_rank_\d+_model_states\.pt", f))
    mp0 = torch.load(os.path.join(tag, mp_files[0]))
    dims = mp0["checkpoint_parallel_dimensions"]
    tp, pp = dims["tp_degree"], dims["pp_degree"]
    dp_sp = mp0["dp_world_size"]
    pipe = mp0["module"] is None
    if len(mp_files) != tp * pp:
        fail(f"{len(mp_files)} mp_rank files for tp={tp} pp={pp}")
    optim = sorted(f for f in os.listdir(tag) if "optim_states" in f)
    if len(optim) != tp * pp * dp_sp:
        fail(f"{len(optim)} optim files for tp={tp} pp={pp} dp*sp={dp_sp}")
    bf16_prefix = optim[0].startswith("bf16_")
    fp32_by_stage = collections.defaultdict(dict)  # (tp) -> {stage: {name: {state: tensor}}}
    checked = 0
    for stage in range(pp):
        for r in range(tp):
            mp = stage * tp + r
            name = f"mp_rank_{mp:02d}_model_states.pt"
            sd = torch.load(os.path.join(tag, name))
            if list(sd.keys())[:len(ENGINE_KEYS)] != ENGINE_KEYS:
                fail(f"{name}: keys {list(sd.keys())}")
            if sd["dp_world_size"] != dp_sp or sd["mp_world_size"] != tp * pp:
                fail(f"{name}: dp_world_size {sd['dp_world_size']} mp_world_size "
                     f"{sd['mp_world_size']}")
            if not isinstance(sd["sparse_tensor_module_names"], set):
                fail(f"{name}: sparse_tensor_module_names is not a set")
            shapes = sd["param_shapes"]
            if not all(isinstance(g, collections.OrderedDict) for g in shapes) or not all(
                    isinstance(s, torch.Size) for g in shapes for s in g.values()):
                fail(f"{name}: param_shapes is not a list of OrderedDicts of torch.Size")
            weights = {}
            if pipe:
                for f in sorted(os.listdir(tag)):
                    m = re.fullmatch(r"layer_(\d+)-model_(\d+)-model_states\.pt", f)
                    if m and int(m.group(2)) == r:
                        layer = torch.load(os.path.join(tag, f))
                        if not isinstance(layer, collections.OrderedDict):
                            fail(f"{f}: not an OrderedDict")
                        idx = int(m.group(1))
                        tied = any(k2.startswith("tied_modules.") for g in shapes for k2 in g)
                        for k, v in layer.items():
                            weights["tied_modules.embed." + k if idx == 1 and tied
                                    else f"{idx}.{k}"] = v
            else:
                if not isinstance(sd["module"], collections.OrderedDict):
                    fail(f"{name}: module is not an OrderedDict")
                # GPTModel's module is nested as Megatron-DeepSpeed saves it (language_model ->
                # embedding -> word_embeddings -> weight, encoder -> flat layer keys); the
                # engine names are the dotted paths.
                weights = {}

                def flatten(d, prefix):
                    for k, v in d.items():
                        if isinstance(v, collections.OrderedDict):
                            flatten(v, prefix + k + ".")
                        else:
                            weights[prefix + k] = v
                flatten(sd["module"], "")
                if any(k.startswith("language_model.") for k in weights) and \
                        "language_model" not in sd["module"]:
                    fail(f"{name}: GPTModel's module is flat, not nested under language_model")
            flat = {}  # engine name -> state -> list of fragments
            for d in range(dp_sp):
                oname = ("bf16_" if bf16_prefix else "") + \
                    f"zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt"
                top = torch.load(os.path.join(tag, oname))
                if list(top.keys()) != ["optimizer_state_dict", "ds_config", "ds_version"]:
                    fail(f"{oname}: top-level keys {list(top.keys())}")
                osd = top["optimizer_state_dict"]
                bf16 = "zero_stage" not in osd
                # The loss scaler (fp16 without a source to carry it from) and clip_grad (no
                # source) may be left to the engine; the rest is always there, in this order.
                optional = {"loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad"}
                want_keys = [k for k in (BF16_KEYS if bf16 else ZERO_KEYS)
                             if k in osd or k not in optional]
                if list(osd.keys()) != want_keys:
                    fail(f"{oname}: keys {list(osd.keys())}")
                if not bf16:
                    if not isinstance(osd["zero_stage"], standin.ZeroStageEnum):
                        fail(f"{oname}: zero_stage is {type(osd['zero_stage'])}")
                    if "loss_scaler" in osd and not isinstance(osd["loss_scaler"],
                                                               standin.LossScaler) and \
                            type(osd["loss_scaler"]).__name__ != "DynamicLossScaler":
                        fail(f"{oname}: loss_scaler is {type(osd['loss_scaler'])}")
                base = osd["base_optimizer_state"]
                groups = len(shapes)
                if (len(base["state"]) != groups or len(osd["single_partition_of_fp32_groups"])
                        != groups or osd["partition_count"] != [dp_sp] * groups):
                    fail(f"{oname}: {groups} param groups but state "
                         f"{len(base['state'])}, partition_count {osd['partition_count']}")
                for g in range(groups):
                    if base["param_groups"][g]["params"] != [g]:
                        fail(f"{oname}: param_groups[{g}].params {base['param_groups'][g]['params']}")
                    st = base["state"][g]
                    size = st["exp_avg"].numel()
                    pad = osd["group_paddings"][g]
                    if d != dp_sp - 1 and pad != 0:
                        fail(f"{oname}: group_paddings[{g}] = {pad} on partition {d}")
                    fp32 = osd["single_partition_of_fp32_groups"][g]
                    want_len = size if bf16 else max(0, size - pad)
                    if fp32.numel() != want_len or st["exp_avg_sq"].numel() != size or \
                            fp32.dtype != torch.float32 or not fp32.requires_grad:
                        fail(f"{oname}: group {g} fp32 {fp32.numel()} exp_avg {size} padding {pad}")
                    # The whole partition, padding included (ZeRO saves a trimmed view of it).
                    whole = torch.tensor([], dtype=torch.float32).set_(
                        fp32.storage(), 0, torch.Size([size])) if size else fp32
                    full = {"fp32": whole.detach(), "exp_avg": st["exp_avg"],
                            "exp_avg_sq": st["exp_avg_sq"]}
                    used = torch.zeros(size, dtype=torch.bool)
                    for pname, fa in osd["param_slice_mappings"][g].items():
                        if not isinstance(fa, standin.fragment_address):
                            fail(f"{oname}: {pname} mapping is {type(fa)}")
                            continue
                        if fa.start < 0 or fa.start + fa.numel > size or fa.numel <= 0:
                            fail(f"{oname}: {pname} fragment {fa} outside {size}")
                            continue
                        used[fa.start:fa.start + fa.numel] = True
                        for s in STATES:
                            flat.setdefault(pname, {}).setdefault(s, []).append(
                                full[s][fa.start:fa.start + fa.numel].clone())
                    for s in STATES:
                        rest = full[s][~used]
                        if rest.numel() and bool((rest != 0).any()):
                            fail(f"{oname}: group {g} {s}: alignment padding is not zero")
            for g in shapes:
                for pname, shape in g.items():
                    if pname not in flat:
                        fail(f"pp {stage} tp {r}: {pname} has no fragment")
                        continue
                    states = {s: torch.cat(flat[pname][s]) for s in STATES}
                    if states["fp32"].numel() != shape.numel():
                        fail(f"pp {stage} tp {r}: {pname}: fragments hold "
                             f"{states['fp32'].numel()} elements, param_shapes {tuple(shape)}")
                        continue
                    states = {s: t.reshape(shape) for s, t in states.items()}
                    fp32_by_stage[r].setdefault(stage, {})[pname] = states
                    if tp != 1:
                        continue
                    cname = canonical(pname, layers)
                    if cname not in uni:
                        fail(f"{pname} ({cname}) is not in the universal checkpoint")
                        continue
                    rows = uni[cname]["shape"][0] if uni[cname]["shape"] else 0
                    for s in STATES:
                        want = uni_state(cname, s)
                        got = states[s].numpy()
                        if got.shape != want.shape:
                            if got.shape[1:] != want.shape[1:] or got.shape[0] < want.shape[0]:
                                fail(f"{pname}/{s}: shape {got.shape} vs {want.shape}")
                                continue
                            if (got[rows:] != 0).any():
                                fail(f"{pname}/{s}: vocabulary padding rows are not zero")
                            got = got[:rows]
                        if got.tobytes() != want.tobytes():
                            fail(f"{pname}/{s}: differs from the universal checkpoint")
                    checked += 1
                    if pname in weights:
                        w = weights[pname]
                        want = uni_state(cname, "model")
                        got = raw(w)
                        if tuple(w.shape) != tuple(shape):
                            fail(f"{pname}: module weight {tuple(w.shape)} vs {tuple(shape)}")
                        elif got[:want.nbytes] != want.tobytes():
                            fail(f"{pname}: module weight differs from the universal checkpoint")
    # GPTModelPipe: the last stage's copy of the tied module holds stage 0's values.
    for r, stages in fp32_by_stage.items():
        if pp > 1 and 0 in stages and pp - 1 in stages:
            for pname, states in stages[pp - 1].items():
                if pname.startswith("tied_modules.") and pname in stages[0]:
                    for s in STATES:
                        if raw(states[s]) != raw(stages[0][pname][s]):
                            fail(f"tp {r}: {pname}/{s}: last stage's copy differs from stage 0's")
    if problems:
        print(f"FAIL {save_dir}: {len(problems)} problems")
        for p in problems:
            print("  " + p)
        sys.exit(1)
    print(f"ok {save_dir}: tp={tp} pp={pp} dp*sp={dp_sp}, {checked} parameters compared with "
          f"{universal}")


if __name__ == "__main__":
    main()
