#!/usr/bin/python3
"""Checks files that ucp's TorchWriter wrote by loading them with real torch.load.

Usage: torch_load_check.py DIR FIXTURE_SCRIPT

For each DIR/*.expect.json (written by torch_writer_test next to the .pt file it describes):
  "file": the .pt name;
  "same_as": optional path of a torch-written file whose torch.load result must deep-equal this
             one (tensors bitwise, numpy arrays bitwise, inert objects by class and attributes);
  "tensors": [{path, dtype, shape, requires_grad, is_parameter, hex}] checked bitwise;
  "values": [{path, kind, value}] for scalars, globals, sizes and types;
  "keys": [{path, keys}] key order of dicts;
  "aliases": [[path_a, path_b]] pairs that must load as the same Python object.
Path steps: a str or int indexes, "@attr:NAME" takes an attribute. Exits 1 on the first mismatch.
FIXTURE_SCRIPT is tools/make_torch_fixtures.py, imported for its DeepSpeed/Megatron stand-ins.
"""

import enum
import glob
import importlib.util
import json
import os
import struct
import sys

import numpy as np
import torch


def load(path):
    return torch.load(path, map_location="cpu")


def step(obj, s):
    if isinstance(s, str) and s.startswith("@attr:"):
        return getattr(obj, s[len("@attr:"):])
    return obj[s]


def resolve(obj, path):
    for s in path:
        obj = step(obj, s)
    return obj


def tensor_bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def deep_equal(a, b, where):
    if type(a) is not type(b):
        return f"{where}: type {type(a).__module__}.{type(a).__qualname__} vs " \
               f"{type(b).__module__}.{type(b).__qualname__}"
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape or a.requires_grad != b.requires_grad:
            return f"{where}: tensor {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        if tensor_bytes(a) != tensor_bytes(b):
            return f"{where}: tensor bytes differ"
        return None
    if isinstance(a, np.ndarray):
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            return f"{where}: numpy array differs"
        return None
    if isinstance(a, dict):
        if list(a.keys()) != list(b.keys()):
            return f"{where}: keys {list(a.keys())} vs {list(b.keys())}"
        for k in a:
            r = deep_equal(a[k], b[k], f"{where}[{k!r}]")
            if r:
                return r
        if hasattr(a, "_metadata") or hasattr(b, "_metadata"):
            return deep_equal(getattr(a, "_metadata", None), getattr(b, "_metadata", None),
                              where + "._metadata")
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            r = deep_equal(x, y, f"{where}[{i}]")
            if r:
                return r
        return None
    if isinstance(a, float):
        if struct.pack("<d", a) != struct.pack("<d", b):
            return f"{where}: float {a!r} vs {b!r}"
        return None
    if isinstance(a, (int, str, bytes, bool, type(None), torch.dtype, set, frozenset,
                      torch.Size)):
        return None if a == b else f"{where}: {a!r} vs {b!r}"
    if isinstance(a, enum.Enum):
        return None if a is b else f"{where}: {a!r} vs {b!r}"
    if hasattr(a, "__dict__"):
        return deep_equal(vars(a), vars(b), where + ".__dict__")
    return None if a == b else f"{where}: {a!r} vs {b!r}"


def check_value(obj, e):
    kind, want = e["kind"], e.get("value")
    if kind == "none":
        return obj is None
    if kind == "bool":
        return obj is want
    if kind == "int":
        return type(obj) is int and obj == int(want)
    if kind == "float_bits":
        return type(obj) is float and struct.pack(">d", obj).hex() == want
    if kind == "str":
        return type(obj) is str and obj == want
    if kind == "bytes":
        return type(obj) is bytes and obj.hex() == want
    if kind == "dtype":
        return obj is getattr(torch, want)
    if kind == "size":
        return type(obj) is torch.Size and list(obj) == want
    if kind == "type":
        t = type(obj)
        return f"{t.__module__}.{t.__qualname__}" == want
    if kind == "len":
        return len(obj) == want
    raise ValueError(f"unknown kind {kind}")


def main():
    out_dir, fixture_script = sys.argv[1], sys.argv[2]
    spec = importlib.util.spec_from_file_location("make_torch_fixtures", fixture_script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # registers the deepspeed/megatron stand-in modules
    checked = 0
    for exp_path in sorted(glob.glob(os.path.join(out_dir, "*.expect.json"))):
        with open(exp_path) as f:
            exp = json.load(f)
        name = exp["file"]
        obj = load(os.path.join(out_dir, name))
        if "same_as" in exp:
            err = deep_equal(load(exp["same_as"]), obj, name)
            if err:
                print(f"FAIL {err}")
                return 1
        for t in exp.get("tensors", []):
            x = resolve(obj, t["path"])
            where = f"{name} {t['path']}"
            if not isinstance(x, torch.Tensor):
                print(f"FAIL {where}: not a tensor but {type(x)}")
                return 1
            if str(x.dtype) != "torch." + t["dtype"] or list(x.shape) != t["shape"]:
                print(f"FAIL {where}: {x.dtype}{list(x.shape)}, want {t['dtype']}{t['shape']}")
                return 1
            if x.requires_grad != t["requires_grad"] or \
                    isinstance(x, torch.nn.Parameter) != t["is_parameter"]:
                print(f"FAIL {where}: requires_grad/parameter flags differ")
                return 1
            if tensor_bytes(x).hex() != t["hex"]:
                print(f"FAIL {where}: bytes differ")
                return 1
        for v in exp.get("values", []):
            x = resolve(obj, v["path"])
            if not check_value(x, v):
                print(f"FAIL {name} {v['path']}: {x!r} is not {v['kind']} {v.get('value')!r}")
                return 1
        for k in exp.get("keys", []):
            keys = list(resolve(obj, k["path"]).keys())
            if keys != k["keys"]:
                print(f"FAIL {name} {k['path']}: keys {keys}, want {k['keys']}")
                return 1
        for a, b in exp.get("aliases", []):
            if resolve(obj, a) is not resolve(obj, b):
                print(f"FAIL {name}: {a} and {b} are not the same object")
                return 1
        checked += 1
    print(f"torch_load_check: {checked} files ok")
    return 0 if checked > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
