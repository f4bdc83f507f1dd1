#!/usr/bin/python3
"""Writes the small torch.save fixtures in tests/data/torch/ and their expected.json.

Run with Debian's python3 and python3-torch (torch 1.13):
    /usr/bin/python3 tools/make_torch_fixtures.py tests/data/torch

Every file is deterministic (seeded). expected.json lists, per file, each tensor reachable through
dicts, lists and tuples (its key path, ucp dtype name, shape, stride, storage offset,
requires_grad and the sha256 of its contiguous bytes), plus a few scalar, object and global
values that ucp's reader must reproduce. DeepSpeed and Megatron are not installed here, so the
script defines stand-in classes under their real module names: the pickles name exactly the
globals real DeepSpeed files name (deepspeed.runtime.fp16.loss_scaler.LossScaler, ...).
"""

import argparse
import collections
import hashlib
import json
import os
import random
import sys

import numpy as np
import torch

UCP_DTYPE = {
    torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
    torch.int8: "int8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
    torch.uint8: "uint8", torch.bool: "bool",
}


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixture_standins import LossScaler, ModelType, ZeroStageEnum, fragment_address  # noqa: E402,F401


def contiguous_bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def walk(value, path, out):
    """Yields (path, tensor) through dicts, lists and tuples, in order."""
    if isinstance(value, torch.Tensor):
        out.append((path, value))
    elif isinstance(value, dict):
        for k, v in value.items():
            walk(v, path + [k], out)
    elif isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        for i, v in enumerate(value):
            walk(v, path + [i], out)


def describe(obj):
    found = []
    walk(obj, [], found)
    tensors = []
    for path, t in found:
        tensors.append({
            "path": path,
            "dtype": UCP_DTYPE[t.dtype],
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "storage_offset": t.storage_offset(),
            "requires_grad": bool(t.requires_grad),
            "is_parameter": isinstance(t, torch.nn.Parameter),
            "sha256": hashlib.sha256(contiguous_bytes(t)).hexdigest(),
        })
    return tensors


def state_dict_fixture():
    torch.manual_seed(1234)

    class TinyNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(5, 3)
            self.bn = torch.nn.BatchNorm1d(3)
            self.emb = torch.nn.Embedding(4, 2)

    net = TinyNet()
    net.bn(torch.randn(6, 3))  # moves running stats and num_batches_tracked (a 0-dim int64)
    sd = net.state_dict()
    sd["fc.weight_T"] = sd["fc.weight"].t()  # shares fc.weight's storage, transposed
    big = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    sd["big"] = big
    sd["big_rows_2_5"] = big[2:5]  # offset view
    sd["big_col_1"] = big[:, 1]  # strided view
    sd["big_step"] = big[1, ::3]  # offset and stride
    sd["expanded"] = torch.tensor([7.5], dtype=torch.float64).expand(4)  # stride 0
    sd["channels_last"] = torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last)
    sd["empty"] = torch.zeros(2, 0)
    sd["scalar_f32"] = torch.tensor(3.25)
    g = torch.Generator().manual_seed(7)
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        sd["x_" + UCP_DTYPE[dt]] = torch.randn(3, 4, generator=g).to(dt)
    for dt in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        sd["x_" + UCP_DTYPE[dt]] = torch.randint(-100 if dt != torch.uint8 else 0, 100, (5,),
                                                 generator=g).to(dt)
    sd["x_bool"] = torch.tensor([True, False, True, True])
    return sd


def adamw_fixture():
    torch.manual_seed(99)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return opt.state_dict()


def model_states_fixture():
    torch.manual_seed(5)
    np.random.seed(11)
    random.seed(13)
    module = collections.OrderedDict()
    module["embed.weight"] = torch.randn(8, 4).half()
    module["layers.0.weight"] = torch.randn(4, 4).half()
    module["layers.0.bias"] = torch.randn(4).half()
    param_shapes = [collections.OrderedDict(
        (k, v.shape) for k, v in module.items())]
    args = argparse.Namespace(
        num_layers=1, hidden_size=4, params_dtype=torch.float16, fp16=True, bf16=False,
        model_type=ModelType.encoder_or_decoder, lr=3e-4, seq_length=16, tensor_model_parallel_size=1,
        data_path=None, rampup_batch_size=["1", "1", "100"])
    return {
        "module": module,
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": param_shapes,
        "frozen_param_shapes": None,
        "shared_params": {},
        "lr_scheduler": {"num_steps": 10, "last_lr": [0.0003]},
        "sparse_tensor_module_names": set(),
        "skipped_steps": 0,
        "global_steps": 10,
        "global_samples": 160,
        "dp_world_size": 1,
        "mp_world_size": 1,
        "ds_config": {"train_batch_size": 16, "fp16": {"enabled": True}, "zero_optimization":
                      {"stage": 1}},
        "ds_version": "0.14.0",
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": 10,
        "dtype": torch.float16,
        "big_int": 2**70 + 5,
        "neg_int": -(2**40),
        "blob": b"\x00\x01\xfe\xff",
        "rng_state": [{
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
        }],
    }


def optim_states_fixture():
    torch.manual_seed(6)
    numels = [32, 16, 4]
    total = sum(numels)
    padded = 56  # aligned partition with trailing padding
    flat = torch.zeros(padded)
    flat[:total] = torch.randn(total)
    names = ["embed.weight", "layers.0.weight", "layers.0.bias"]
    mapping = collections.OrderedDict()
    start = 0
    for name, n in zip(names, numels):
        mapping[name] = fragment_address(numel=n, start=start)
        start += n
    state = {0: {"step": torch.tensor(10.0), "exp_avg": torch.randn(padded),
                 "exp_avg_sq": torch.rand(padded)}}
    param_groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                     "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                     "params": [0]}]
    return {
        "optimizer_state_dict": {
            "loss_scaler": LossScaler(65536.0),
            "dynamic_loss_scale": True,
            "overflow": False,
            "clip_grad": 1.0,
            "base_optimizer_state": {"state": state, "param_groups": param_groups},
            "single_partition_of_fp32_groups": [flat[:total]],  # a view of the padded storage
            "zero_stage": ZeroStageEnum.optimizer_states,
            "group_paddings": [padded - total],
            "partition_count": [1],
            "ds_version": "0.14.0",
            "param_slice_mappings": [mapping],
        },
        "ds_config": {"train_batch_size": 16},
        "ds_version": "0.14.0",
    }


def scalar_expectations(name):
    """Values other than tensors that the C++ test checks, by path; '@state' steps into BUILD."""
    if name == "mp_rank_00_model_states.pt":
        return [
            {"path": ["iteration"], "kind": "int", "value": 10},
            {"path": ["ds_version"], "kind": "str", "value": "0.14.0"},
            {"path": ["checkpoint_version"], "kind": "float", "value": 3.0},
            {"path": ["optimizer"], "kind": "none"},
            {"path": ["dtype"], "kind": "global", "value": "torch.float16"},
            {"path": ["neg_int"], "kind": "int", "value": -(2**40)},
            {"path": ["big_int"], "kind": "bigint",
             "value": (2**70 + 5).to_bytes(9, "little", signed=True).hex()},
            {"path": ["blob"], "kind": "bytes", "value": "0001feff"},
            {"path": ["sparse_tensor_module_names"], "kind": "set", "value": 0},
            {"path": ["args"], "kind": "object", "value": "argparse.Namespace"},
            {"path": ["args", "@state", "hidden_size"], "kind": "int", "value": 4},
            {"path": ["args", "@state", "params_dtype"], "kind": "global",
             "value": "torch.float16"},
            {"path": ["args", "@state", "model_type"], "kind": "object",
             "value": "megatron.core.enums.ModelType"},
            {"path": ["param_shapes", 0, "layers.0.weight"], "kind": "torch.Size",
             "value": [4, 4]},
            {"path": ["rng_state", 0, "np_rng_state", 0], "kind": "str", "value": "MT19937"},
            {"path": ["rng_state", 0, "np_rng_state", 1], "kind": "object",
             "value": "numpy.core.multiarray._reconstruct"},
            {"path": ["rng_state", 0, "random_rng_state", 0], "kind": "int", "value": 3},
        ]
    if name == "zero_pp_rank_0_mp_rank_00_optim_states.pt":
        return [
            {"path": ["optimizer_state_dict", "loss_scaler"], "kind": "object",
             "value": "deepspeed.runtime.fp16.loss_scaler.LossScaler"},
            {"path": ["optimizer_state_dict", "loss_scaler", "@state", "cur_scale"],
             "kind": "float", "value": 65536.0},
            {"path": ["optimizer_state_dict", "zero_stage"], "kind": "object",
             "value": "deepspeed.runtime.zero.config.ZeroStageEnum"},
            {"path": ["optimizer_state_dict", "group_paddings", 0], "kind": "int", "value": 4},
            {"path": ["optimizer_state_dict", "param_slice_mappings", 0, "layers.0.bias"],
             "kind": "object", "value": "deepspeed.utils.tensor_fragment.fragment_address"},
            {"path": ["optimizer_state_dict", "param_slice_mappings", 0, "layers.0.bias",
                      "@state", "start"], "kind": "int", "value": 48},
            {"path": ["optimizer_state_dict", "base_optimizer_state", "param_groups", 0, "lr"],
             "kind": "float", "value": 3e-4},
            {"path": ["optimizer_state_dict", "base_optimizer_state", "param_groups", 0,
                      "foreach"], "kind": "none"},
        ]
    if name == "adamw_optimizer.pt":
        return [
            {"path": ["param_groups", 0, "weight_decay"], "kind": "float", "value": 0.01},
            {"path": ["param_groups", 0, "params"], "kind": "list", "value": 4},
        ]
    return []


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    out = ap.parse_args().out_dir
    os.makedirs(out, exist_ok=True)
    sd = state_dict_fixture()
    files = [
        ("model_state_dict.pt", sd, {}, "zip"),
        ("model_state_dict_legacy.pt", sd, {"_use_new_zipfile_serialization": False}, "legacy"),
        ("protocol4.pt", collections.OrderedDict(list(sd.items())[:4]), {"pickle_protocol": 4},
         "zip"),
        ("adamw_optimizer.pt", adamw_fixture(), {}, "zip"),
        ("mp_rank_00_model_states.pt", model_states_fixture(), {}, "zip"),
        ("zero_pp_rank_0_mp_rank_00_optim_states.pt", optim_states_fixture(), {}, "zip"),
    ]
    expected = {"torch_version": torch.__version__, "files": {}}
    for name, obj, kwargs, fmt in files:
        torch.save(obj, os.path.join(out, name), **kwargs)
        expected["files"][name] = {"format": fmt, "tensors": describe(obj),
                                   "values": scalar_expectations(name)}
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
