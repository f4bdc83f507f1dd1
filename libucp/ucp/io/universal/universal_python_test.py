#!/usr/bin/env python3
"""Reads universal checkpoints written by ucp with plain h5py and h5dump, and validates the
manifest against schemas/manifest.schema.json with jsonschema.

Usage: universal_python_test.py FIXTURE_BINARY PLUGIN_DIR SCHEMA WORK_DIR
Checks, for an uncompressed and a zstd-compressed checkpoint:
  * manifest.json validates against the schema, and copies with an unknown key, a missing key or
    a bad checksum do not (so the schema cannot drift into accepting anything);
  * every dataset h5py reads equals, byte for byte, what ucp meant to write, with h5py's dtype
    (float32, float16, bool, uint16 for bf16, uint8 for fp8 ...) and the dtype attribute;
  * attributes name, shape, step;
  * h5dump (HDF5_PLUGIN_PATH set to our plugin) dumps the same bytes of a compressed dataset,
    and without the plugin h5py cannot read it (the plugin is what makes it work).
"""
import json
import os
import shutil
import subprocess
import sys

import h5py
import jsonschema
import numpy as np

H5PY_DTYPE = {
    "fp64": "<f8", "fp32": "<f4", "fp16": "<f2", "bf16": "<u2", "fp8_e4m3": "|u1",
    "fp8_e5m2": "|u1", "int8": "|i1", "int16": "<i2", "int32": "<i4", "int64": "<i8",
    "uint8": "|u1", "bool": "|b1",
}


def check(cond, msg):
    if not cond:
        print("FAIL:", msg)
        sys.exit(1)


def run_in_child(code, env):
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def main():
    fixture, plugin_dir, schema_path, work = sys.argv[1:5]
    schema = json.load(open(schema_path))
    validator = jsonschema.Draft202012Validator(schema)
    shutil.rmtree(work, ignore_errors=True)
    for level in (0, 3):
        d = os.path.join(work, "level%d" % level)
        subprocess.run([fixture, d, str(level)], check=True)
        ckpt = os.path.join(d, "ckpt")
        manifest = json.load(open(os.path.join(ckpt, "manifest.json")))
        validator.validate(manifest)
        bad = json.loads(json.dumps(manifest))
        bad["params"][0]["extra"] = 1
        check(not validator.is_valid(bad), "schema accepts an unknown key")
        bad = json.loads(json.dumps(manifest))
        del bad["params"][0]["file"]
        check(not validator.is_valid(bad), "schema accepts a missing file")
        bad = json.loads(json.dumps(manifest))
        bad["params"][0]["states"][0]["checksum"] = "xxh3-64:XYZ"
        check(not validator.is_valid(bad), "schema accepts a bad checksum")
        bad = json.loads(json.dumps(manifest))
        bad["params"][0]["file"] = "../x.h5"
        check(not validator.is_valid(bad), "schema accepts a file escaping the folder")

        env = dict(os.environ, HDF5_PLUGIN_PATH=plugin_dir)
        rows = [l.rstrip("\n").split("\t") for l in open(os.path.join(d, "expected", "index.tsv"))]
        check(len(rows) == 2 * len(H5PY_DTYPE), "index has %d rows" % len(rows))
        # h5py reads compressed files only through the plugin: run the reads in a child that has
        # HDF5_PLUGIN_PATH set before HDF5 initialises.
        code = r'''
import sys, h5py, numpy as np
H5PY_DTYPE = %r
rows = %r
d = %r
step = %d
for file, ds, dtype, shape, bin_ in rows:
    with h5py.File(d + "/ckpt/" + file, "r") as f:
        x = f[ds][()]
        want = open(d + "/expected/" + bin_, "rb").read()
        assert x.dtype.str == H5PY_DTYPE[dtype], (file, ds, x.dtype.str, dtype)
        assert x.shape == tuple(int(s) for s in shape.split(",")), (file, ds, x.shape)
        assert x.tobytes() == want, ("bytes differ", file, ds)
        attr = f[ds].attrs["dtype"]
        assert attr == dtype, (attr, dtype)
        assert list(f.attrs["shape"]) == list(x.shape)
        assert int(f.attrs["step"]) == step
        assert isinstance(f.attrs["name"], str)
        if dtype == "bool":
            assert x.dtype == np.bool_
print("ok", len(rows))
''' % (H5PY_DTYPE, rows, d, manifest["step"])
        r = run_in_child(code, env)
        check(r.returncode == 0 and r.stdout.startswith("ok"), "h5py read failed: " + r.stdout + r.stderr)

        file, ds, dtype, shape, bin_ = rows[0]
        out = os.path.join(d, "h5dump.bin")
        r = subprocess.run(["h5dump", "-d", "/" + ds, "-b", "LE", "-o", out,
                            os.path.join(ckpt, file)], env=env, capture_output=True, text=True)
        check(r.returncode == 0, "h5dump failed: " + r.stdout + r.stderr)
        check(open(out, "rb").read() == open(os.path.join(d, "expected", bin_), "rb").read(),
              "h5dump bytes differ for %s %s" % (file, ds))
        if level:
            h = subprocess.run(["h5dump", "-H", "-p", "-d", "/" + ds, os.path.join(ckpt, file)],
                               env=env, capture_output=True, text=True).stdout
            check("FILTER_ID 32015" in h and "SHUFFLE" in h, "no zstd+shuffle pipeline:\n" + h)
            empty = os.path.join(work, "empty-plugins")
            os.makedirs(empty, exist_ok=True)
            r = run_in_child(code, dict(os.environ, HDF5_PLUGIN_PATH=empty))
            check(r.returncode != 0 and ("Can't read data" in r.stderr or "32015" in r.stderr),
                  "compressed data was readable without the plugin: " + r.stdout + r.stderr)
        print("level %d: schema, h5py (%d datasets) and h5dump agree" % (level, len(rows)))
    print("PASS")


if __name__ == "__main__":
    main()
