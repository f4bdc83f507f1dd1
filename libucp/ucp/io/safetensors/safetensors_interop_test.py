#!/usr/bin/env python3
"""Interop of ucp's safetensors reader and writer with the real Python library.

Run by ctest (safetensors_interop_test, label integration) as
`/usr/bin/python3 safetensors_interop_test.py <safetensors_interop_tool>`. It needs an interpreter
that imports both torch and safetensors (0.4.5 is pinned: see docs/safetensors_format.md); when
this one cannot, it re-runs itself under the first that can of $UCP_SAFETENSORS_PYTHON,
$UCP_PEER_VENV/bin/python, ~/.cache/ucp/peer-venv/bin/python and
$UCP_BINARY_DIR/st-venv/bin/python, and exits 77 (skipped) when none can.

Checks, for several tensor sets (every dtype torch 1.13 has, 0-d and empty tensors, names that
need JSON escapes, with and without metadata):
  1. a file written by save_file is read by ucp bitwise (dtype, shape, bytes, metadata);
  2. ucp's copy of it (read with ucp, written with ucp) is byte-identical to it (with two or more
     metadata keys, whose order the crate leaves to a HashMap: the same header, parsed, and the
     same data bytes);
  3. save_file's file and ucp's are loaded by load_file / safe_open bitwise equal to the originals.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

SKIP = 77


def _reexec_or_skip():
    candidates = [os.environ.get("UCP_SAFETENSORS_PYTHON")]
    if os.environ.get("UCP_PEER_VENV"):
        candidates.append(os.path.join(os.environ["UCP_PEER_VENV"], "bin", "python"))
    candidates.append(os.path.expanduser("~/.cache/ucp/peer-venv/bin/python"))
    if os.environ.get("UCP_BINARY_DIR"):
        candidates.append(os.path.join(os.environ["UCP_BINARY_DIR"], "st-venv", "bin", "python"))
    for py in candidates:
        if not py or not os.access(py, os.X_OK) or os.environ.get("UCP_ST_REEXEC") == py:
            continue
        probe = subprocess.run([py, "-c", "import torch, safetensors.torch"],
                               capture_output=True)
        if probe.returncode == 0:
            env = dict(os.environ, UCP_ST_REEXEC=py)
            os.execve(py, [py, os.path.abspath(__file__)] + sys.argv[1:], env)
    print("skip: no python with torch and safetensors (tools/setup_peers.sh installs it)")
    sys.exit(SKIP)


try:
    import torch
    import safetensors
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
except ImportError:
    _reexec_or_skip()

TOOL = sys.argv[1]
DTYPES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
    torch.int32: "I32", torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float32: "F32", torch.float64: "F64",
}
for name, st in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, name):  # torch >= 2.1
        DTYPES[getattr(torch, name)] = st


def raw(t):
    """The tensor's bytes, whatever its dtype (bf16 and bool included)."""
    flat = t.contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).numpy()) if flat.numel() else b""


def random_tensor(gen, dtype, shape):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).to(torch.bool)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    bits = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    # Any bit pattern (NaNs included): round trips move bytes, not values.
    return bits.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)


def tensor_sets():
    gen = torch.Generator().manual_seed(1234)
    every = {}
    for i, dtype in enumerate(DTYPES):
        every[f"layer.{i}.{DTYPES[dtype].lower()}"] = random_tensor(gen, dtype, (3, 5))
        every[f"scalar.{DTYPES[dtype]}"] = random_tensor(gen, dtype, ())
        every[f"empty.{DTYPES[dtype]}"] = random_tensor(gen, dtype, (4, 0))
    yield "every_dtype", every, {"format": "pt"}
    yield "no_metadata", {"w": random_tensor(gen, torch.float32, (7,))}, None
    escapes = {
        'q"uote': random_tensor(gen, torch.float16, (2,)),
        "back\\slash": random_tensor(gen, torch.int64, (1,)),
        "new\nline\ttab\x01\x1f": random_tensor(gen, torch.bfloat16, (3,)),
        "unicod\u00e9\u4e2d\U0001f600": random_tensor(gen, torch.int8, (5,)),
        "/slash": random_tensor(gen, torch.float32, (1, 1)),
    }
    yield "escaped_names", escapes, {"format": "pt"}
    # Two metadata keys: the crate keeps them in a HashMap, so its order (and bytes) vary from run
    # to run; ucp sorts them. Compared as parsed headers plus identical data.
    yield "two_metadata_keys", escapes, {"format": "pt", "k\"ey": "v\\al\n"}
    yield "empty_file", {}, {"format": "pt"}
    yield "model_like", {
        "model.embed_tokens.weight": random_tensor(gen, torch.bfloat16, (64, 32)),
        "model.layers.0.self_attn.q_proj.weight": random_tensor(gen, torch.bfloat16, (32, 32)),
        "model.layers.0.input_layernorm.weight": random_tensor(gen, torch.float32, (32,)),
        "lm_head.weight": random_tensor(gen, torch.bfloat16, (64, 32)),
        "model.norm.weight": random_tensor(gen, torch.float32, (32,)),
    }, {"format": "pt"}


def parse_dump(path):
    meta, tensors = {}, {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            unhex = lambda s: b"" if s == "-" else bytes.fromhex(s)
            if parts[0] == "m":
                meta[unhex(parts[1]).decode()] = unhex(parts[2]).decode()
            else:
                shape = () if parts[3] == "-" else tuple(int(d) for d in parts[3].split(","))
                tensors[unhex(parts[1]).decode()] = (parts[2], shape, unhex(parts[4]))
    return meta, tensors


def run(*args):
    r = subprocess.run([TOOL, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise AssertionError(f"{' '.join(args)}: {r.stderr.strip()}")


def check_same(loaded, tensors, what):
    assert set(loaded) == set(tensors), f"{what}: names {sorted(loaded)} != {sorted(tensors)}"
    for name, t in tensors.items():
        got = loaded[name]
        assert got.dtype == t.dtype and tuple(got.shape) == tuple(t.shape), f"{what}: {name!r}"
        assert raw(got) == raw(t), f"{what}: bytes of {name!r} differ"


def main():
    print(f"safetensors {safetensors.__version__}, torch {torch.__version__}")
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for label, tensors, metadata in tensor_sets():
            try:
                theirs = os.path.join(tmp, f"{label}.theirs.safetensors")
                ours = os.path.join(tmp, f"{label}.ours.safetensors")
                save_file(tensors, theirs, metadata=metadata)
                # 1. ucp reads save_file's file bitwise.
                run("dump", theirs, os.path.join(tmp, f"{label}.dump"))
                meta, dumped = parse_dump(os.path.join(tmp, f"{label}.dump"))
                assert meta == (metadata or {}), f"metadata {meta} != {metadata}"
                assert set(dumped) == set(tensors), f"names {sorted(dumped)}"
                for name, t in tensors.items():
                    dtype, shape, data = dumped[name]
                    assert dtype == DTYPES[t.dtype], f"{name!r}: dtype {dtype}"
                    assert shape == tuple(t.shape), f"{name!r}: shape {shape}"
                    assert data == raw(t), f"{name!r}: bytes differ"
                # 2. ucp writes the same bytes as save_file.
                run("copy", theirs, ours)
                with open(theirs, "rb") as a, open(ours, "rb") as b:
                    a, b = a.read(), b.read()
                if metadata is None or len(metadata) <= 1:
                    assert a == b, "ucp's file differs from save_file's"
                else:
                    assert len(a) == len(b) and a[:8] == b[:8], "header sizes differ"
                    n = 8 + struct.unpack("<Q", a[:8])[0]
                    assert json.loads(a[8:n]) == json.loads(b[8:n]), "headers differ"
                    assert a[n:] == b[n:], "data areas differ"
                # 3. the library loads ucp's file bitwise, metadata included.
                check_same(load_file(ours), tensors, "load_file(ucp)")
                with safe_open(ours, framework="pt") as f:
                    assert f.metadata() == metadata, f"safe_open metadata {f.metadata()}"
                print(f"ok   {label} ({len(tensors)} tensors, {os.path.getsize(ours)} bytes)")
            except AssertionError as e:
                failures += 1
                print(f"FAIL {label}: {e}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
