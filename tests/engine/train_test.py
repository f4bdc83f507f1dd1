"""ucp-train (offload/offload/train) against PyTorch: whole optimizer steps, not one gradient.

Both cases make the training split of a token file hold exactly `global_batch` samples, so each
step trains on all of them (one epoch in the sampler's order): the mean loss and the gradient do
not depend on the order, and PyTorch reproduces every step without the sampler. The held-out
split (the last ntok // 10 tokens) must hold a sample too (ucp-train validates after its last
step), hence seq_len 16 and a global batch of 10: 180 tokens, 162 for training
((162 - 1) // 16 = 10 samples), 18 held out.

  --case parity   llama-tiny and gpt-tiny at --dtype fp32, 8 steps from a universal fp32
                  checkpoint whose weights are parity_test.py's "sharp" set (the generated
                  uniform +-0.05 weights rescaled, written back into the HDF5 files with fresh
                  XXH3 checksums; a plain generate when libxxhash cannot be loaded), constant lr,
                  AdamW (decoupled weight decay on every parameter), clipping active on some steps
                  and not on others. Every step's loss (1e-5 relative) and grad norm (1e-5) are
                  asserted against torch float32 (torch.optim.AdamW + clip_grad_norm_); torch
                  float64 is reported, saying which side is the closer; the final weights
                  (`ucp extract` of the run's last checkpoint) are compared with torch's.
  --case fixture  --init from the Megatron-DeepSpeed fixtures (LLaMA tp2 pp2 dp2 and GPT tp1 pp2
                  dp2, bf16 with fp32 masters): step 1's loss equals torch's loss of the fixture's
                  fp32 weights (`ucp extract` + torch_ref.load_universal) to 1e-5; step 2's is
                  finite, differs, and equals torch's after one AdamW step (1e-5).

  /usr/bin/python3 tests/engine/train_test.py --case parity --ucp BUILD/bin/ucp \
      --train BUILD/bin/ucp-train --work /tmp/train_parity [--keep]
Exit 0: pass; 1: a mismatch; 77: torch or h5py missing (ctest skips).
"""

import argparse
import ctypes
import ctypes.util
import json
import math
import os
import shutil
import subprocess
import sys
import time

import numpy as np

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    import h5py
    import torch
    import torch_ref
    from parity_test import sharpen
except ImportError as e:  # h5py or torch missing
    print("skip: %s" % e)
    sys.exit(77)

REL_TOL = 1e-5
SEQ, BATCH, MICRO, NTOK = 16, 10, 2, 180
TOKEN_MAGIC = 20240520

# name, preset, generate seed, --clip-grad, steps. The clip levels sit inside the range of the
# runs' gradient norms (the test asserts that some steps clip and some do not).
PARITY_CASES = [
    ("llama-tiny", "llama-tiny", 21, 4.3, 8),
    ("gpt-tiny", "gpt-tiny", 22, 3.1, 8),
]
# name, fixture folder (under tests/data/deepspeed)
FIXTURE_CASES = [
    ("megatron-llama", "megatron_llama_tp2_pp2_dp2_bf16"),
    ("megatron-gpt", "megatron_tp1_pp2_dp2_bf16"),
]
HYPER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def run(cmd):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise RuntimeError("%s: exit %d\n%s" % (" ".join(cmd), r.returncode, r.stdout))
    return r.stdout


def rel(a, b):
    """Norm-wise relative error of a against reference b (float64)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    nb = np.linalg.norm(b)
    d = np.linalg.norm(a - b)
    return d / nb if nb > 0 else (0.0 if d == 0 else float("inf"))


def write_tokens(path, vocab, seed):
    """An llm.c token file of NTOK random tokens < vocab; returns the training samples as
    (inputs, targets) int64 [BATCH, SEQ]: sample i = tokens[i*SEQ : i*SEQ + SEQ + 1]."""
    tokens = np.random.default_rng(seed).integers(0, vocab, NTOK).astype("<u2")
    header = np.zeros(256, "<i4")
    header[:3] = (TOKEN_MAGIC, 1, NTOK)
    with open(path, "wb") as f:
        f.write(header.tobytes() + tokens.tobytes())
    train = NTOK - NTOK // 10
    assert (train - 1) // SEQ == BATCH and (NTOK // 10 - 1) // SEQ >= 1
    rows = np.stack([tokens[i * SEQ:i * SEQ + SEQ + 1] for i in range(BATCH)]).astype(np.int64)
    return rows[:, :-1], rows[:, 1:]


def train_args(args, init, data, out, steps, clip):
    return [args.train, "--init", init, "--data", data, "--dtype", "fp32", "--seq-len", str(SEQ),
            "--global-batch", str(BATCH), "--micro-batch", str(MICRO), "--steps", str(steps),
            "--warmup-samples", "0", "--decay-samples", "0", "--lr", repr(HYPER["lr"]),
            "--beta1", repr(HYPER["betas"][0]), "--beta2", repr(HYPER["betas"][1]),
            "--eps", repr(HYPER["eps"]), "--weight-decay", repr(HYPER["weight_decay"]),
            "--clip-grad", repr(clip), "--val-every", "0", "--sync-save", "--threads", "2",
            "--out", out, "-q"]


def read_log(run_dir):
    steps = []
    with open(os.path.join(run_dir, "log.jsonl")) as f:
        for line in f:
            j = json.loads(line)
            if "loss" in j:
                steps.append(j)
    return steps


# ---------------------------------------------------------------------------------------------
# Writing weights into a universal checkpoint (docs/format.md): in-place HDF5 writes, fresh
# XXH3-64 checksums through libxxhash (ucp's own dependency), loaded with ctypes.

def load_xxh3():
    name = ctypes.util.find_library("xxhash")
    for cand in ([name] if name else []) + ["libxxhash.so.0", "libxxhash.so"]:
        try:
            lib = ctypes.CDLL(cand)
            fn = lib.XXH3_64bits
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint64
        fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        return lambda b: "xxh3-64:%016x" % fn(b, len(b))
    return None


def write_universal_weights(ckpt, weights, xxh3):
    """Replaces the `model` and `fp32` states (fp32 checkpoint) of every parameter by `weights`
    (logical shapes), updating the manifest's checksums. Checks first that the hash reproduces
    the existing checksums (the right function on the right bytes)."""
    path = os.path.join(ckpt, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    for p in manifest["params"]:
        with h5py.File(os.path.join(ckpt, p["file"]), "r+") as h5:
            for s in p["states"]:
                if s["name"] not in ("model", "fp32"):
                    continue
                ds = h5[s["name"]]
                if ds.dtype != np.dtype("<f4") or ds.compression is not None:
                    raise RuntimeError("%s/%s: not an uncompressed fp32 dataset" % (p["name"],
                                                                                    s["name"]))
                if xxh3(np.ascontiguousarray(ds[()]).tobytes()) != s["checksum"]:
                    raise RuntimeError("XXH3 via libxxhash does not reproduce %s/%s's checksum"
                                       % (p["name"], s["name"]))
                new = np.ascontiguousarray(weights[p["name"]], dtype="<f4")
                ds[...] = new
                s["checksum"] = xxh3(new.tobytes())
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)


# ---------------------------------------------------------------------------------------------
# The PyTorch side: torch_ref's model, clip_grad_norm_, torch.optim.AdamW on every parameter.

def torch_run(weights, cfg, inputs, targets, steps, clip, dtype):
    """`steps` optimizer steps on the whole batch. weights: padded numpy. Returns per-step
    records (mean loss, pre-clip norm) and the final weights (numpy, padded)."""
    p = {n: torch.tensor(np.asarray(w), dtype=dtype, requires_grad=True)
         for n, w in weights.items()}
    names = torch_ref.param_names(cfg)
    opt = torch.optim.AdamW([p[n] for n in names], lr=HYPER["lr"], betas=HYPER["betas"],
                            eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])
    inp = torch.as_tensor(inputs)
    tgt = torch.as_tensor(targets)
    n_tok = tgt.numel()
    # The engine's fp32 grad_scale 1/n_tok, exactly (fp64: the exact scale).
    scale = float(np.float32(1.0) / np.float32(n_tok)) if dtype == torch.float32 else 1.0 / n_tok
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss_sum = torch_ref.forward_loss(p, cfg, inp, tgt)
        (loss_sum * scale).backward()
        norm = float(torch.nn.utils.clip_grad_norm_([p[n] for n in names],
                                                    clip if clip > 0 else float("inf")))
        opt.step()
        out.append({"loss": float(loss_sum.detach()) / n_tok, "grad_norm": norm})
    return out, {n: t.detach().numpy().copy() for n, t in p.items()}


def torch_loss(weights, cfg, inputs, targets, dtype):
    p = {n: torch.tensor(np.asarray(w), dtype=dtype) for n, w in weights.items()}
    with torch.no_grad():
        return float(torch_ref.forward_loss(p, cfg, torch.as_tensor(inputs),
                                            torch.as_tensor(targets))) / targets.size


def compare_steps(tag, eng, t32, t64, clip, problems):
    """Per step: engine vs torch float32 (asserted) and float64 (reported)."""
    rows = []
    for i, (e, a, b) in enumerate(zip(eng, t32, t64)):
        r = {"step": e["step"], "loss": e["loss"], "norm": e["grad_norm"],
             "loss_e32": abs(e["loss"] - a["loss"]) / abs(a["loss"]),
             "loss_e64": abs(e["loss"] - b["loss"]) / abs(b["loss"]),
             "loss_3264": abs(a["loss"] - b["loss"]) / abs(b["loss"]),
             "norm_e32": abs(e["grad_norm"] - a["grad_norm"]) / a["grad_norm"],
             "norm_e64": abs(e["grad_norm"] - b["grad_norm"]) / b["grad_norm"],
             "norm_3264": abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"],
             "clipped": clip > 0 and e["grad_norm"] > clip}
        rows.append(r)
        if not math.isfinite(e["loss"]) or e["step"] != i + 1 or e["skipped"]:
            problems.append("%s: step %d: bad log line %s" % (tag, i + 1, e))
        if min(r["loss_e32"], r["loss_e64"]) > REL_TOL:
            problems.append("%s: step %d: loss %.9g vs torch %.9g (rel %.3g, vs fp64 %.3g)"
                            % (tag, i + 1, e["loss"], a["loss"], r["loss_e32"], r["loss_e64"]))
        if min(r["norm_e32"], r["norm_e64"]) > REL_TOL:
            problems.append("%s: step %d: grad norm %.9g vs torch %.9g (rel %.3g, vs fp64 %.3g)"
                            % (tag, i + 1, e["grad_norm"], a["grad_norm"], r["norm_e32"],
                               r["norm_e64"]))
        if abs(e["lr"] - HYPER["lr"]) > 1e-12:
            problems.append("%s: step %d: lr %.9g, expected the constant %.9g"
                            % (tag, i + 1, e["lr"], HYPER["lr"]))
    return rows


def print_rows(rows):
    print("  step  loss          grad_norm    clip | loss rel: e-t32   e-t64    t32-t64"
          "  | norm rel: e-t32   e-t64    t32-t64")
    for r in rows:
        print("  %4d  %.9f  %.6e  %-4s |        %.2e %.2e %.2e |        %.2e %.2e %.2e"
              % (r["step"], r["loss"], r["norm"], "yes" if r["clipped"] else "no",
                 r["loss_e32"], r["loss_e64"], r["loss_3264"],
                 r["norm_e32"], r["norm_e64"], r["norm_3264"]))
    closer = sum(r["loss_e64"] < r["loss_3264"] for r in rows)
    print("  engine closer to torch float64 than torch float32 is: %d of %d steps (loss), "
          "%d of %d (norm)" % (closer, len(rows), sum(r["norm_e64"] < r["norm_3264"]
                                                      for r in rows), len(rows)))


def key_rows(cfg):
    """Boolean mask of the key rows of a fused QKV output [(H + 2G) * D] (Megatron groups)."""
    H, G, D = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    per = H // G
    m = np.zeros((G, (per + 2) * D), dtype=bool)
    m[:, per * D:(per + 1) * D] = True
    return m.reshape(-1)


def final_weights(args, run_dir, steps, work):
    ckpt = os.path.join(run_dir, "step_%08d" % steps)
    uni = os.path.join(work, "final_universal")
    shutil.rmtree(uni, ignore_errors=True)
    run([args.ucp, "extract", ckpt, uni, "--threads", "1"])
    cfg, w = torch_ref.load_universal(uni, "fp32")
    return torch_ref.pad_vocab(cfg, w)


def parity_case(args, name, preset, seed, clip, steps, xxh3, problems):
    before = len(problems)
    work = os.path.join(args.work, name)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    ckpt = os.path.join(work, "init")
    run([args.ucp, "generate", "--model", preset, "--layout", "universal", "--dtype", "fp32",
         "--seed", str(seed), "--out", ckpt, "--threads", "1"])
    cfg, logical = torch_ref.load_universal(ckpt, "fp32")
    variant = "generated"
    if xxh3 is not None:
        write_universal_weights(ckpt, sharpen(cfg, logical), xxh3)
        run([args.ucp, "verify", ckpt])
        cfg, logical = torch_ref.load_universal(ckpt, "fp32")
        variant = "sharp"
    weights = torch_ref.pad_vocab(cfg, logical)
    data = os.path.join(work, "tokens.bin")
    inputs, targets = write_tokens(data, cfg["vocab"], seed)

    out = os.path.join(work, "run")
    t0 = time.time()
    run(train_args(args, ckpt, data, out, steps, clip))
    t_engine = time.time() - t0
    eng = read_log(out)
    t0 = time.time()
    t32, w32 = torch_run(weights, cfg, inputs, targets, steps, clip, torch.float32)
    t64, w64 = torch_run(weights, cfg, inputs, targets, steps, clip, torch.float64)
    t_torch = time.time() - t0
    tag = "%s/%s" % (name, variant)
    if len(eng) != steps:
        problems.append("%s: %d step lines in log.jsonl, expected %d" % (tag, len(eng), steps))
        return
    rows = compare_steps(tag, eng, t32, t64, clip, problems)
    clipped = [r["clipped"] for r in rows]
    if all(clipped) or not any(clipped):
        problems.append("%s: --clip-grad %g clips %s step: choose a level inside the norms %s"
                        % (tag, clip, "every" if all(clipped) else "no",
                           ["%.4g" % r["norm"] for r in rows]))
    if eng[-1]["loss"] >= eng[0]["loss"]:
        problems.append("%s: the loss did not go down (%.6f -> %.6f)"
                        % (tag, eng[0]["loss"], eng[-1]["loss"]))
    # Torch's clip decisions must be the engine's (a norm right at the level would flip them).
    for r, a in zip(rows, t32):
        if (a["grad_norm"] > clip) != r["clipped"]:
            problems.append("%s: step %d: torch and the engine disagree on clipping" % (tag,
                                                                                       r["step"]))
    wf = final_weights(args, out, steps, work)
    names = torch_ref.param_names(cfg)
    # The key rows of a QKV bias have an exactly zero gradient (softmax ignores q.b_k, the same
    # for every key): only rounding noise, which Adam's m / sqrt(v) turns into steps of ~lr in
    # either fp32 run. Compared on their own, not asserted.
    kb = [n for n in names if n.endswith("query_key_value.bias")]
    kmask = key_rows(cfg)
    flat = [np.concatenate([(w[n][~kmask] if n in kb else w[n]).reshape(-1) for n in names])
            for w in (wf, w32, w64, weights)]
    init = flat.pop()
    e32, e64, d3264 = rel(flat[0], flat[1]), rel(flat[0], flat[2]), rel(flat[1], flat[2])
    # Relative to how far training moved the weights (the update, not the weights).
    moved = np.linalg.norm(flat[2] - init)
    u32 = np.linalg.norm(flat[0] - flat[1]) / moved
    u64 = np.linalg.norm(flat[0] - flat[2]) / moved
    u3264 = np.linalg.norm(flat[1] - flat[2]) / moved
    print("%-12s %s  (%s weights, clip %g, %d steps; ucp-train %.2f s, torch fp32+fp64 %.2f s)"
          % (name, "ok" if len(problems) == before else "FAIL", variant, clip, steps, t_engine,
             t_torch))
    print_rows(rows)
    print("  final weights, ||a-b||/||b||: e-t32 %.2e  e-t64 %.2e  t32-t64 %.2e;  "
          "relative to the update ||w8-w0||: e-t32 %.2e  e-t64 %.2e  t32-t64 %.2e"
          % (e32, e64, d3264, u32, u64, u3264))
    if kb:
        kd = [np.concatenate([w[n][kmask] for n in kb]) for w in (wf, w32, w64)]
        print("  QKV key-bias rows (zero true gradient, not asserted): max |e-t64| %.2e, "
              "|t32-t64| %.2e (lr %g: rounding noise amplified by Adam)"
              % (np.abs(kd[0] - kd[2]).max(), np.abs(kd[1] - kd[2]).max(), HYPER["lr"]))
    if u64 > max(2e-4, 3 * u3264):
        problems.append("%s: final weights %.3g of the update from torch float64 (torch float32: "
                        "%.3g)" % (tag, u64, u3264))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def fixture_case(args, name, folder, problems):
    before = len(problems)
    fixture = os.path.join(args.fixtures, folder)
    work = os.path.join(args.work, name)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    uni = os.path.join(work, "universal")
    run([args.ucp, "extract", fixture, uni, "--threads", "1"])
    cfg, logical = torch_ref.load_universal(uni, "fp32")
    weights = torch_ref.pad_vocab(cfg, logical)
    if cfg["max_positions"] and cfg["max_positions"] < SEQ:
        problems.append("%s: max_positions %d < seq_len %d" % (name, cfg["max_positions"], SEQ))
        return
    data = os.path.join(work, "tokens.bin")
    inputs, targets = write_tokens(data, cfg["vocab"], 7)
    out = os.path.join(work, "run")
    t0 = time.time()
    run(train_args(args, fixture, data, out, 2, 1.0))
    t_engine = time.time() - t0
    eng = read_log(out)
    if len(eng) != 2:
        problems.append("%s: %d step lines in log.jsonl, expected 2" % (name, len(eng)))
        return
    l32 = torch_loss(weights, cfg, inputs, targets, torch.float32)
    l64 = torch_loss(weights, cfg, inputs, targets, torch.float64)
    t32, _ = torch_run(weights, cfg, inputs, targets, 2, 1.0, torch.float32)
    t64, _ = torch_run(weights, cfg, inputs, targets, 2, 1.0, torch.float64)
    e1, e2 = eng[0]["loss"], eng[1]["loss"]
    r1 = (abs(e1 - l32) / l32, abs(e1 - l64) / l64, abs(l32 - l64) / l64)
    if min(r1[:2]) > REL_TOL:
        problems.append("%s: step 1 loss %.9g vs torch %.9g (rel %.3g)" % (name, e1, l32, r1[0]))
    if not math.isfinite(e2) or e2 == e1:
        problems.append("%s: step 2 loss %.9g (step 1: %.9g)" % (name, e2, e1))
    rows = compare_steps(name, eng, t32, t64, 1.0, problems)
    # The fixture's bf16 model weights give another loss: step 1 matching the fp32 one says
    # --init took the fp32 masters (not the bf16 copy widened).
    _, model_state = torch_ref.load_universal(uni, "model")
    lbf = torch_loss(torch_ref.pad_vocab(cfg, model_state), cfg, inputs, targets, torch.float64)
    rbf = abs(e1 - lbf) / lbf
    if abs(lbf - l64) / l64 > 10 * REL_TOL and rbf <= REL_TOL:
        problems.append("%s: step 1 loss is the bf16 weights' (%.9g), not the fp32 masters'"
                        % (name, lbf))
    print("%-15s %s  (%s, %s; vocab %d, max_positions %d; ucp-train %.2f s)"
          % (name, "ok" if len(problems) == before else "FAIL", folder, cfg["family"],
             cfg["vocab"], cfg["max_positions"], t_engine))
    print("  step-1 loss: engine %.9f  torch32 %.9f  torch64 %.9f   rel e-t32 %.2e e-t64 %.2e "
          "t32-t64 %.2e" % ((e1, l32, l64) + r1))
    print("  the fixture's bf16 model weights would give %.9f (rel %.2e from the fp32 masters')"
          % (lbf, abs(lbf - l64) / l64))
    print_rows(rows)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=("parity", "fixture"), required=True)
    ap.add_argument("--ucp", required=True)
    ap.add_argument("--train", required=True, help="the ucp-train binary")
    ap.add_argument("--work", required=True)
    ap.add_argument("--fixtures", help="tests/data/deepspeed (default: from this file)",
                    default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                         "data", "deepspeed"))
    ap.add_argument("--keep", action="store_true", help="keep the work folders")
    ap.add_argument("--only", help="run one case by name")
    args = ap.parse_args()
    torch.set_num_threads(2)
    os.makedirs(args.work, exist_ok=True)
    problems = []
    if args.case == "parity":
        xxh3 = load_xxh3()
        if xxh3 is None:
            print("note: libxxhash not loadable: training from the generated weights as they are")
        for name, preset, seed, clip, steps in PARITY_CASES:
            if args.only and name != args.only:
                continue
            try:
                parity_case(args, name, preset, seed, clip, steps, xxh3, problems)
            except RuntimeError as e:
                problems.append("%s: %s" % (name, e))
    else:
        for name, folder in FIXTURE_CASES:
            if args.only and name != args.only:
                continue
            try:
                fixture_case(args, name, folder, problems)
            except RuntimeError as e:
                problems.append("%s: %s" % (name, e))
    for p in problems:
        print("  " + p)
    if problems:
        print("FAILED: %d problem(s)" % len(problems))
        return 1
    print("all pass (relative tolerance %.0e)" % REL_TOL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
