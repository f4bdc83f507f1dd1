#!/usr/bin/env python3
"""Issue 16 #6: DeepSpeed client state that JSON cannot hold as text, and a NaN learning rate.

Usage: client_state_fixture.py strings TAG_DIR   adds to mp_rank_00's Megatron args a str with a
                                                 lone surrogate, a Python 2 byte string (STRING
                                                 opcode, raw non-UTF-8 bytes), bytes, and keys
                                                 that need escaping; prints the expected values
       client_state_fixture.py check FILE        prints those values as torch.load reads them
       client_state_fixture.py nan TAG_DIR       sets param_groups[0].lr of every optimizer file
                                                 to NaN
       client_state_fixture.py callable TAG_DIR  adds to the args a value that unpickles by
                                                 calling `deepspeed.evil.run` (a module made up
                                                 here: only the name is pickled)
Needs Debian's torch (/usr/bin/python3)."""
import glob
import os
import pickletools
import struct
import sys
import types
import zipfile

import torch

PY2_PLACEHOLDER = "UCP_PY2_STRING_PLACEHOLDER"
PY2_BYTES = b"caf\xe9 \xff\x80"  # latin-1 text, as Python 2 pickled a str: not UTF-8


def rewrite_pickle(path, edit):
    """Replaces data.pkl inside a torch zip file with edit(bytes), keeping every other record."""
    with zipfile.ZipFile(path) as z:
        entries = [(i, z.read(i.filename)) for i in z.infolist()]
    tmp = path + ".new"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as z:
        for info, data in entries:
            if info.filename.endswith("/data.pkl"):
                data = edit(data)
            z.writestr(info.filename, data)
    os.replace(tmp, path)


def strings(tag):
    path = os.path.join(tag, "mp_rank_00_model_states.pt")
    sd = torch.load(path, map_location="cpu")
    args = sd["args"]
    args.surrogate_note = "lone \udcff surrogate"
    args.py2_note = PY2_PLACEHOLDER
    args.raw_bytes = b"\x00\x01\xfe"
    args.escapes = {"py/str": "a real key", "k\udce9y": 1, "plain": [1.5, "x"]}
    torch.save(sd, path)

    def edit(pkl):
        # BINUNICODE 'X' <u32 len> text -> SHORT_BINSTRING 'U' <u8 len> raw bytes, what Python 2
        # wrote for a str; the memo indices that follow do not move.
        old = b"X" + len(PY2_PLACEHOLDER).to_bytes(4, "little") + PY2_PLACEHOLDER.encode()
        assert pkl.count(old) == 1, "placeholder not found once"
        return pkl.replace(old, b"U" + bytes([len(PY2_BYTES)]) + PY2_BYTES)

    rewrite_pickle(path, edit)
    check(path)


def check(path):
    # encoding='bytes' as one must for Python 2 strings that are not UTF-8; Python 3 str stay str.
    sd = torch.load(path, map_location="cpu", encoding="bytes")
    args = sd[b"args"] if b"args" in sd else sd["args"]
    d = vars(args)
    get = lambda k: d[k] if k in d else d[k.encode()]
    print("surrogate_note", ascii(get("surrogate_note")))
    print("py2_note", ascii(get("py2_note")))
    print("raw_bytes", ascii(get("raw_bytes")))
    print("escapes", ascii(sorted(get("escapes").items(), key=lambda kv: ascii(kv[0]))))


def nan(tag):
    # Patched in the pickle's bytes (the files name DeepSpeed's classes, which Debian's torch
    # alone cannot load): every float that follows the key 'lr' becomes NaN.
    def edit(pkl):
        ops = list(pickletools.genops(pkl))
        out = bytearray(pkl)
        patched = 0
        for i, (op, arg, _) in enumerate(ops):
            if arg != "lr" or "UNICODE" not in op.name:
                continue
            for op2, _, pos2 in ops[i + 1:i + 4]:
                if op2.name == "BINFLOAT":
                    out[pos2 + 1:pos2 + 9] = struct.pack(">d", float("nan"))
                    patched += 1
                    break
        assert patched > 0, "no lr float found"
        return bytes(out)

    for path in glob.glob(os.path.join(tag, "*optim_states.pt")):
        rewrite_pickle(path, edit)


def callable_global(tag):
    mod = types.ModuleType("deepspeed.evil")

    def run(cmd):
        return cmd

    run.__module__, run.__qualname__ = "deepspeed.evil", "run"
    mod.run = run
    sys.modules.setdefault("deepspeed", types.ModuleType("deepspeed"))
    sys.modules["deepspeed.evil"] = mod

    class Payload:
        def __reduce__(self):
            return (run, ("touch pwned",))

    path = os.path.join(tag, "mp_rank_00_model_states.pt")
    sd = torch.load(path, map_location="cpu")
    sd["args"].hook = Payload()
    torch.save(sd, path)


if __name__ == "__main__":
    {"strings": strings, "check": check, "nan": nan, "callable": callable_global}[sys.argv[1]](sys.argv[2])
