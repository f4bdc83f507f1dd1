#!/usr/bin/python3
"""Checks with real torch a DeepSpeed universal folder that ucp wrote.

    ds_universal_check.py OUT expected.pt NUM_MP_FILES

Every parameter of expected.pt (ucp canonical names) must be in OUT/zero/<GPTModelPipe name>/ as
fp32.pt, exp_avg.pt, exp_avg_sq.pt (dicts with 'param' float32 at the logical shape, equal to the
expected tensor bit for bit, 'cat_dim' for sharded ones, 'vocab_tensor' for the vocabulary) and
step.pt; zero/optimizer_state.pt holds param_groups; NUM_MP_FILES model-state files load;
nothing was written next to OUT (no latest_universal: ucp writes only inside its output).
"""
import enum
import os
import sys
import types

import torch


def _define(module_name, cls):
    """Stand-ins for the DeepSpeed classes the copied optimizer state names."""
    parts = module_name.split(".")
    for i in range(1, len(parts) + 1):
        sub = ".".join(parts[:i])
        if sub not in sys.modules:
            sys.modules[sub] = types.ModuleType(sub)
    cls.__module__ = module_name
    setattr(sys.modules[module_name], cls.__name__, cls)


class LossScaler:
    pass


class ZeroStageEnum(int, enum.Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


_define("deepspeed.runtime.fp16.loss_scaler", LossScaler)
_define("deepspeed.runtime.zero.config", ZeroStageEnum)


def pipe_name(canon, layers):
    if canon.startswith("embedding."):
        return "tied_modules.embed." + canon[len("embedding."):]
    if canon.startswith("layers."):
        _, i, rest = canon.split(".", 2)
        return f"{int(i) + 2}.{rest}"
    return f"{layers + 2}.{canon.split('.')[-1]}"


def main():
    out, expected_path, num_mp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    expected = torch.load(expected_path)
    layers = 1 + max(int(n.split(".")[1]) for n in expected if n.startswith("layers."))
    errors = []
    for name, states in expected.items():
        folder = os.path.join(out, "zero", pipe_name(name, layers))
        for s in ("fp32", "exp_avg", "exp_avg_sq"):
            want = states[s]
            d = torch.load(os.path.join(folder, s + ".pt"))
            got = d["param"]
            if got.dtype != torch.float32 or got.shape != want.shape or not torch.equal(
                    got.view(torch.int32), want.view(torch.int32)):
                errors.append(f"{folder}/{s}.pt: param differs")
            sharded = "query_key_value" in name or "dense_h_to_4h" in name or (
                name.endswith("dense.weight") or name.endswith("dense_4h_to_h.weight"))
            keys = {"param"}
            if sharded:
                keys.add("cat_dim")
                want_dim = 1 if name.endswith(("self_attention.dense.weight",
                                               "dense_4h_to_h.weight")) else 0
                if d.get("cat_dim") != want_dim:
                    errors.append(f"{folder}/{s}.pt: cat_dim {d.get('cat_dim')} != {want_dim}")
            if name == "embedding.word_embeddings.weight":
                keys |= {"cat_dim", "vocab_tensor"}
                if d.get("vocab_tensor") is not True:
                    errors.append(f"{folder}/{s}.pt: vocab_tensor not set")
            if set(d) != keys:
                errors.append(f"{folder}/{s}.pt: keys {sorted(d)} != {sorted(keys)}")
        step = torch.load(os.path.join(folder, "step.pt"))
        if float(step) != 7.0:
            errors.append(f"{folder}/step.pt: {step}")
    osd = torch.load(os.path.join(out, "zero", "optimizer_state.pt"))
    if [g["params"] for g in osd["param_groups"]] != [[0], [1]] or "clip_grad" not in osd:
        errors.append(f"optimizer_state.pt: {sorted(osd)}")
    for i in range(num_mp):
        ms = torch.load(os.path.join(out, f"mp_rank_{i:02d}_model_states.pt"))
        if ms["iteration"] != 7 or ms["args"].hidden_size != 16:
            errors.append(f"mp_rank_{i:02d}: iteration {ms['iteration']}")
    beside = sorted(set(os.listdir(os.path.dirname(os.path.abspath(out)))) -
                    {os.path.basename(os.path.abspath(out))})
    if beside:
        errors.append(f"written outside {out}: {beside}")
    for e in errors:
        print(e)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
