"""The engine's models (offload_model_dump) against PyTorch autograd (torch_ref.py).

For each model: `ucp generate` a universal checkpoint, draw random tokens (a few targets masked
with -1), run offload_model_dump (rank 0 of tp=1,pp=1,dp=1 restored from the checkpoint), and
compare its loss and every gradient with torch_ref in float32 (asserted: norm-wise relative
error ||cpp - torch|| / ||torch|| <= 1e-5 per tensor) and float64 (reported, to say which side
is the more accurate). The engine's float64 oracle (model_ref.h, --ref) must match torch float64
to 1e-12: the same definition, not merely the same to rounding. Weight sets per model:
  ckpt   the fp32 master weights as generated (uniform +-0.05: near-uniform softmax, loss ~
         ln(vocab), q/k gradients tiny); the restored weights must equal h5py's read, with zero
         padded vocab rows;
  bf16   (presets) a bf16 checkpoint restored from its model slices (--state model), equal to
         h5py's read of the `model` state widened to fp32;
  sharp  (engine on 2 threads) the ckpt weights rescaled in Python (norm weights 1 + w,
         embeddings x10, linear weights x6) through --weights: peaked attention (mean top
         probability ~0.5) and a loss well away from ln(vocab), so every nonlinearity counts.
A tensor passes when the engine is within 1e-5 of torch float32 or, should the two fp32 sides
round apart, within 1e-5 of float64 (then torch float32 is the less accurate side). Also
asserted: Forward's loss == ForwardBackward's, same bits on a second call, and a call into a
buffer holding g gives 2g (to 1e-6: the += sums round in their own order).
Before all that, torch_ref itself is checked against naive numpy loops and torch.optim.AdamW.

  /usr/bin/python3 tests/engine/parity_test.py --ucp BUILD/bin/ucp \
      --dump BUILD/tests/engine/offload_model_dump --work /tmp/parity [--keep] [--only NAME]
Exit 0: all pass; 1: a mismatch; 77: torch or h5py missing (ctest skips).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    import torch
    import torch_ref
except ImportError as e:  # h5py or torch missing
    print("skip: %s" % e)
    sys.exit(77)

REL_TOL = 1e-5
REF_TOL = 1e-12  # the engine's float64 oracle vs torch float64

# name, preset or model JSON (dict), batch, seq_len, seed
CASES = [
    ("gpt-tiny", "gpt-tiny", 2, 32, 11),
    ("llama-tiny", "llama-tiny", 3, 24, 12),
    ("llama-tiny-tied", "llama-tiny-tied", 2, 16, 13),
    # GQA 8 query heads over 2 groups, head_dim 16 != hidden / heads = 8, odd vocab padding.
    ("llama-gqa", {"name": "llama-gqa", "family": "llama", "dtype": "fp32",
                   "source": "parity test: GQA 8/2, head_dim 16 != hidden/heads",
                   "hyper": {"hidden": 64, "layers": 2, "heads": 8, "kv_heads": 2,
                             "head_dim": 16, "ffn_hidden": 80, "vocab": 101,
                             "max_positions": 64, "make_vocab_size_divisible_by": 32,
                             "tied_embeddings": False}}, 2, 20, 14),
    # GPT with an untied output layer.
    ("gpt-untied", {"name": "gpt-untied", "family": "gpt", "dtype": "fp32",
                    "source": "parity test: gpt-tiny untied",
                    "hyper": {"hidden": 64, "layers": 2, "heads": 4, "ffn_hidden": 128,
                              "vocab": 120, "max_positions": 24,
                              "make_vocab_size_divisible_by": 16, "tied_embeddings": False}},
     2, 24, 15),
]

CASES_BY_NAME = {c[0]: c for c in CASES}


def naive_loss(p, cfg, inputs, targets):
    """The spec once more, element by element in numpy float64 (loops over heads and positions,
    RoPE by explicit pairs): an independent check of torch_ref's reading of the fused QKV
    layout, GQA head mapping, RoPE, masking and the padded head."""
    gpt = cfg["family"] == "gpt"
    H, G, D, F = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["ffn_hidden"]
    per, eps = H // G, cfg["norm_eps"]
    p = {n: np.asarray(a, np.float64) for n, a in p.items()}

    def norm(x, pre):
        w = p[pre + ".weight"]
        if gpt:
            mu = x.mean(-1, keepdims=True)
            return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + \
                p[pre + ".bias"]
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    total = 0.0
    for b in range(inputs.shape[0]):
        T = inputs.shape[1]
        x = p["embedding.word_embeddings.weight"][inputs[b]].copy()
        if gpt:
            x += p["embedding.position_embeddings.weight"][:T]
        for layer in range(cfg["layers"]):
            pre = "layers.%d." % layer
            h = norm(x, pre + "input_layernorm")
            qkv = h @ p[pre + "self_attention.query_key_value.weight"].T
            if gpt:
                qkv += p[pre + "self_attention.query_key_value.bias"]
            out = np.zeros((T, H * D))
            for head in range(H):
                g, j = head // per, head % per
                base = g * (per + 2) * D
                q = qkv[:, base + j * D: base + (j + 1) * D].copy()
                k = qkv[:, base + per * D: base + (per + 1) * D].copy()
                v = qkv[:, base + (per + 1) * D: base + (per + 2) * D]
                if not gpt:
                    for t in range(T):
                        for i in range(D // 2):
                            a = t * cfg["rope_theta"] ** (-2.0 * i / D)
                            c, s = np.cos(a), np.sin(a)
                            for m in (q, k):
                                x0, x1 = m[t, i], m[t, i + D // 2]
                                m[t, i], m[t, i + D // 2] = x0 * c - x1 * s, x1 * c + x0 * s
                for t in range(T):
                    sc = np.array([q[t] @ k[s] for s in range(t + 1)]) / np.sqrt(D)
                    w = np.exp(sc - sc.max())
                    out[t, head * D:(head + 1) * D] = (w / w.sum()) @ v[:t + 1]
            x = x + out @ p[pre + "self_attention.dense.weight"].T
            if gpt:
                x += p[pre + "self_attention.dense.bias"]
            h = norm(x, pre + "post_attention_layernorm")
            u = h @ p[pre + "mlp.dense_h_to_4h.weight"].T
            if gpt:
                u += p[pre + "mlp.dense_h_to_4h.bias"]
                u = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u ** 3)))
            else:
                u = u[:, :F] / (1 + np.exp(-u[:, :F])) * u[:, F:]
            x = x + u @ p[pre + "mlp.dense_4h_to_h.weight"].T
            if gpt:
                x += p[pre + "mlp.dense_4h_to_h.bias"]
        x = norm(x, "final_layernorm")
        head_w = p["embedding.word_embeddings.weight" if cfg["tied"] else "output_layer.weight"]
        logits = x @ head_w[:cfg["vocab"]].T
        for t in range(inputs.shape[1]):
            if targets[b, t] >= 0:
                z = logits[t] - logits[t].max()
                total += np.log(np.exp(z).sum()) - z[targets[b, t]]
    return total


def self_check():
    """torch_ref (float64) against naive_loss on small random models of both families."""
    rng = np.random.default_rng(0)
    for family, tied, kv in (("gpt", True, 4), ("llama", False, 2), ("llama", True, 1)):
        hyper = {"hidden": 16, "layers": 2, "heads": 4, "kv_heads": kv, "head_dim": 6,
                 "ffn_hidden": 12, "vocab": 13, "max_positions": 8,
                 "make_vocab_size_divisible_by": 8, "tied_embeddings": tied}
        cfg = torch_ref.config_from_hyper(family, hyper)
        shapes = {"embedding.word_embeddings.weight": (cfg["padded_vocab"], 16),
                  "embedding.position_embeddings.weight": (8, 16),
                  "output_layer.weight": (cfg["padded_vocab"], 16)}
        qkv_rows = (4 + 2 * kv) * 6
        params = {}
        for n in torch_ref.param_names(cfg):
            leaf = n.split(".", 2)[-1] if n.startswith("layers.") else n
            shape = shapes.get(n) or {
                "self_attention.query_key_value.weight": (qkv_rows, 16),
                "self_attention.query_key_value.bias": (qkv_rows,),
                "self_attention.dense.weight": (16, 24),
                "mlp.dense_h_to_4h.weight": ((24 if family == "llama" else 12), 16),
                "mlp.dense_h_to_4h.bias": (12,),
                "mlp.dense_4h_to_h.weight": (16, 12)}.get(leaf, (16,))
            params[n] = rng.normal(0, 0.5, shape)
            if "layernorm.weight" in n:
                params[n] += 1
        inputs = rng.integers(0, 13, (2, 7))
        targets = rng.integers(0, 13, (2, 7))
        targets[1, 2] = -1
        want = naive_loss(params, cfg, inputs, targets)
        got, _ = torch_ref.loss_and_grads(params, cfg, inputs, targets, 1.0, torch.float64)
        if abs(got - want) > 1e-10 * abs(want):
            raise SystemExit("torch_ref self-check failed for %s: %.15g vs naive %.15g"
                             % (family, got, want))
    # The optimizer reference against torch.optim.AdamW and clip_grad_norm_ (float64).
    shapes = {"a.weight": (5, 3), "a.bias": (5,), "b_layernorm.weight": (3,)}
    p = {n: rng.normal(0, 1, s) for n, s in shapes.items()}
    m = {n: np.zeros(s) for n, s in shapes.items()}
    v = {n: np.zeros(s) for n, s in shapes.items()}
    tp = {n: torch.tensor(a, requires_grad=True) for n, a in p.items()}
    opt = torch.optim.AdamW([{"params": [tp["a.weight"]], "weight_decay": 0.1},
                             {"params": [tp["a.bias"], tp["b_layernorm.weight"]],
                              "weight_decay": 0.0}], lr=1.0, betas=(0.9, 0.95), eps=1e-8)
    for step in range(1, 4):
        g = {n: rng.normal(0, 1, s) for n, s in shapes.items()}
        lr = torch_ref.lr_at(step, 3e-2, 2, 10, 3e-3)
        holders = [torch.zeros(shapes[n], dtype=torch.float64, requires_grad=True)
                   for n in shapes]
        for h, n in zip(holders, shapes):
            h.grad = torch.tensor(g[n])
        torch_norm = float(torch.nn.utils.clip_grad_norm_(holders, 1.0))
        g, norm = torch_ref.clip_grads(g, 1.0)
        if abs(norm - torch_norm) > 1e-12 * torch_norm or any(
                rel(g[n], h.grad.numpy()) > 1e-12 for h, n in zip(holders, shapes)):
            raise SystemExit("clip_grads self-check failed at step %d" % step)
        p, m, v = torch_ref.adamw_step(p, g, m, v, step, lr, (0.9, 0.95), 1e-8, 0.1)
        for n in shapes:
            tp[n].grad = torch.tensor(np.asarray(g[n], np.float64))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        for n in shapes:
            if rel(p[n], tp[n].detach().numpy()) > 1e-6:  # ours rounds to float32 once per step
                raise SystemExit("adamw_step self-check failed at step %d for %s" % (step, n))
    print("torch_ref self-check: agrees with the naive loops (gpt, llama GQA, llama MQA tied) "
          "and torch.optim.AdamW + clip_grad_norm_")


def run(cmd):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise RuntimeError("%s: exit %d\n%s" % (" ".join(cmd), r.returncode, r.stdout))
    return r.stdout


def read_dump(folder):
    with open(os.path.join(folder, "index.json")) as f:
        index = json.load(f)
    flat_w = np.fromfile(os.path.join(folder, "weights.f32"), dtype="<f4")
    flat_g = np.fromfile(os.path.join(folder, "grads.f32"), dtype="<f4")
    ref_path = os.path.join(folder, "grads_ref.f64")

    def unflat(flat):
        return {p["name"]: flat[p["offset"]:p["offset"] + p["numel"]].reshape(p["shape"])
                for p in index["params"]}
    ref = unflat(np.fromfile(ref_path, dtype="<f8")) if os.path.exists(ref_path) else None
    return index, unflat(flat_w), unflat(flat_g), ref


def flatten(index, tensors):
    out = np.zeros(sum(p["numel"] for p in index["params"]), dtype=np.float32)
    for p in index["params"]:
        out[p["offset"]:p["offset"] + p["numel"]] = tensors[p["name"]].reshape(-1)
    return out


def rel(a, b):
    """Norm-wise relative error of a against reference b (float64)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    nb = np.linalg.norm(b)
    d = np.linalg.norm(a - b)
    return d / nb if nb > 0 else (0.0 if d == 0 else float("inf"))


def sharpen(cfg, params):
    """A well-conditioned weight set from the generated one (uniform +-0.05)."""
    out = {}
    for n, w in params.items():
        if "layernorm.weight" in n:
            out[n] = (1.0 + w).astype(np.float32)
        elif n.endswith(".bias"):
            out[n] = w
        elif "embeddings" in n or n == "output_layer.weight":
            out[n] = (10.0 * w).astype(np.float32)
        else:
            out[n] = (6.0 * w).astype(np.float32)
    return out


def qkv_parts(cfg, g):
    """Row blocks q, k, v of a fused QKV gradient [(H+2G)*D, ...], for localizing an error."""
    H, G, D = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    per = H // G
    grouped = g.reshape((G, (per + 2) * D) + g.shape[1:])
    return {"q": grouped[:, :per * D], "k": grouped[:, per * D:(per + 1) * D],
            "v": grouped[:, (per + 1) * D:]}


def compare(name, variant, cfg, index, cpp_grads, ref_grads, weights, inputs, targets, problems):
    """Torch fp32 and fp64 on `weights`; returns a summary dict and appends failures."""
    n_tok = int((targets >= 0).sum())
    scale = np.float32(1.0) / np.float32(n_tok)  # the dump's fp32 grad_scale, exactly
    l32, g32 = torch_ref.loss_and_grads(weights, cfg, inputs, targets, float(scale), torch.float32)
    l64, g64 = torch_ref.loss_and_grads(weights, cfg, inputs, targets, float(scale), torch.float64)
    lc = index["loss_sum"]
    tag = "%s/%s" % (name, variant)
    s = {"tokens": n_tok, "loss_cpp": lc, "loss_t32": l32, "loss_t64": l64,
         "loss_rel_cpp_t32": abs(lc - l32) / abs(l32), "loss_rel_cpp_t64": abs(lc - l64) / abs(l64),
         "loss_rel_t32_t64": abs(l32 - l64) / abs(l64)}
    if min(s["loss_rel_cpp_t32"], s["loss_rel_cpp_t64"]) > REL_TOL:
        problems.append("%s: loss %.9g vs torch %.9g (rel %.3g)" % (tag, lc, l32,
                                                                     s["loss_rel_cpp_t32"]))
    if index["forward_loss_sum"] != lc:
        problems.append("%s: Forward loss %.17g != ForwardBackward loss %.17g"
                        % (tag, index["forward_loss_sum"], lc))
    if not index["deterministic"]:
        problems.append("%s: a second ForwardBackward gave other bits" % tag)
    s["accumulate_rel"] = index["accumulate_rel"]
    if index["accumulate_rel"] > 1e-6:
        problems.append("%s: ForwardBackward into a buffer holding g gave %.3g away from 2g"
                        % (tag, index["accumulate_rel"]))
    worst = {"cpp_t32": (0.0, ""), "cpp_t64": (0.0, ""), "t32_t64": (0.0, "")}
    max_abs = 0.0
    for n in torch_ref.param_names(cfg):
        c, t, d = cpp_grads[n], g32[n], g64[n]
        errs = {"cpp_t32": rel(c, t), "cpp_t64": rel(c, d), "t32_t64": rel(t, d)}
        for k, e in errs.items():
            if e > worst[k][0]:
                worst[k] = (e, n)
        max_abs = max(max_abs, float(np.max(np.abs(c.astype(np.float64) - t))))
        if not np.all(np.isfinite(c)):
            problems.append("%s: %s: non-finite gradient" % (tag, n))
        if min(errs["cpp_t32"], errs["cpp_t64"]) > REL_TOL:
            detail = ""
            if "query_key_value" in n:
                parts_c, parts_t = qkv_parts(cfg, c), qkv_parts(cfg, t)
                detail = " [" + ", ".join("%s rel %.3g" % (k, rel(parts_c[k], parts_t[k]))
                                          for k in parts_c) + "]"
            problems.append("%s: grad %s: rel %.3g (vs fp64: cpp %.3g, torch32 %.3g), norm %.3g%s"
                            % (tag, n, errs["cpp_t32"], errs["cpp_t64"], errs["t32_t64"],
                               np.linalg.norm(t), detail))
        for pad_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if n == pad_name and np.any(c[cfg["vocab"]:] != 0):
                problems.append("%s: %s: nonzero gradient in padded vocab rows" % (tag, n))
    if ref_grads is not None:
        # The engine's double-precision oracle (model_ref.h) against torch float64: the same
        # math to ~1e-12, so anything above REF_TOL is a difference of definition, not rounding.
        lr = index["ref_loss_sum"]
        s["ref_loss_rel_t64"] = abs(lr - l64) / abs(l64)
        s["ref_worst_t64"] = max((rel(ref_grads[n], g64[n]), n) for n in torch_ref.param_names(cfg))
        if s["ref_loss_rel_t64"] > REF_TOL:
            problems.append("%s: oracle loss %.15g vs torch64 %.15g" % (tag, lr, l64))
        for n in torch_ref.param_names(cfg):
            e = rel(ref_grads[n], g64[n])
            if e > REF_TOL:
                problems.append("%s: oracle grad %s: rel %.3g vs torch float64" % (tag, n, e))
    flat = [(np.concatenate([x[n].reshape(-1) for n in torch_ref.param_names(cfg)]))
            for x in (cpp_grads, g32, g64)]
    s.update({"grad_worst": worst, "grad_max_abs_cpp_t32": max_abs,
              "grad_all_rel_cpp_t32": rel(flat[0], flat[1]),
              "grad_all_rel_cpp_t64": rel(flat[0], flat[2]),
              "grad_all_rel_t32_t64": rel(flat[1], flat[2])})
    return s


def check_case(args, name, model, batch, seq_len, seed, problems):
    first_problem = len(problems)
    work = os.path.join(args.work, name)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    if isinstance(model, dict):
        path = os.path.join(work, name + ".json")
        with open(path, "w") as f:
            json.dump(model, f)
        model = path
    ckpt = os.path.join(work, "ckpt")
    run([args.ucp, "generate", "--model", model, "--layout", "universal", "--dtype", "fp32",
         "--seed", str(seed), "--out", ckpt, "--threads", "1"])
    cfg, logical = torch_ref.load_universal(ckpt, "fp32")
    weights = torch_ref.pad_vocab(cfg, logical)

    rng = np.random.default_rng(seed)
    stream = rng.integers(0, cfg["vocab"], size=(batch, seq_len + 1))
    inputs = stream[:, :-1].astype(np.int32)
    targets = stream[:, 1:].astype(np.int32)
    targets[0, -1] = -1  # masked positions contribute no loss
    targets[batch - 1, rng.integers(0, seq_len, size=3)] = -1
    tokens = os.path.join(work, "tokens.i32")
    np.concatenate([inputs.reshape(-1), targets.reshape(-1)]).astype("<i4").tofile(tokens)
    base = [args.dump, "--tokens", tokens, "--batch", str(batch), "--seq-len", str(seq_len)]

    # ckpt: the weights as restored from the checkpoint.
    out = os.path.join(work, "dump_ckpt")
    run(base + ["--ckpt", ckpt, "--out", out, "--ref"])
    index, cpp_w, cpp_g, ref_g = read_dump(out)
    names = torch_ref.param_names(cfg)
    if [p["name"] for p in index["params"]] != names:
        problems.append("%s: engine parameter order %s differs from the canonical %s"
                        % (name, [p["name"] for p in index["params"]][:6], names[:6]))
        return None
    for p in index["params"]:
        if list(weights[p["name"]].shape) != p["shape"]:
            problems.append("%s: %s: engine shape %s, expected %s"
                            % (name, p["name"], p["shape"], list(weights[p["name"]].shape)))
    for k in ("vocab", "padded_vocab", "hidden", "layers", "heads", "kv_heads", "head_dim",
              "ffn_hidden", "tied"):
        if index["config"][k] != cfg[k]:
            problems.append("%s: config %s: engine %s, expected %s"
                            % (name, k, index["config"][k], cfg[k]))
    for n in names:
        if not np.array_equal(cpp_w[n], weights[n]):
            problems.append("%s: restored weight %s differs from h5py's read" % (name, n))
    if len(problems) > first_problem:
        return None
    summary = {"ckpt": compare(name, "ckpt", cfg, index, cpp_g, ref_g, weights, inputs, targets,
                               problems)}

    # The model slices restore the same values (a fp32 checkpoint's model state is fp32).
    out_model = os.path.join(work, "dump_model_state")
    run(base + ["--ckpt", ckpt, "--state", "model", "--out", out_model])
    if not np.array_equal(np.fromfile(os.path.join(out_model, "weights.f32"), "<f4"),
                          np.fromfile(os.path.join(out, "weights.f32"), "<f4")):
        problems.append("%s: --state model restored other weights than fp32" % name)

    # bf16: a checkpoint in the preset's bf16 training dtype, restored from its model slices
    # (bf16 bits widened to fp32): equal to h5py's read of the `model` state.
    if args.bf16 and not isinstance(CASES_BY_NAME[name][1], dict):
        ckpt16 = os.path.join(work, "ckpt_bf16")
        run([args.ucp, "generate", "--model", model, "--layout", "universal", "--seed",
             str(seed), "--out", ckpt16, "--threads", "1"])
        cfg16, model_state = torch_ref.load_universal(ckpt16, "model")
        w16 = torch_ref.pad_vocab(cfg16, model_state)
        out16 = os.path.join(work, "dump_bf16")
        run(base + ["--ckpt", ckpt16, "--state", "model", "--out", out16, "--ref"])
        index16, cpp_w16, cpp_g16, ref_g16 = read_dump(out16)
        for n in names:
            if not np.array_equal(cpp_w16[n], w16[n]):
                problems.append("%s: bf16 model slice %s restored other values than h5py's"
                                % (name, n))
        summary["bf16"] = compare(name, "bf16", cfg, index16, cpp_g16, ref_g16, w16, inputs,
                                  targets, problems)

    # sharp: rescaled weights through --weights.
    sharp = sharpen(cfg, weights)
    wfile = os.path.join(work, "sharp.f32")
    flatten(index, sharp).astype("<f4").tofile(wfile)
    out = os.path.join(work, "dump_sharp")
    run(base + ["--ckpt", ckpt, "--weights", wfile, "--out", out, "--ref", "--threads", "2"])
    index, _, cpp_g, ref_g = read_dump(out)
    summary["sharp"] = compare(name, "sharp", cfg, index, cpp_g, ref_g, sharp, inputs, targets,
                               problems)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return summary


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ucp", required=True)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--keep", action="store_true", help="keep the work folders")
    ap.add_argument("--only", help="run one case by name")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false",
                    help="skip the bf16 model-slice variant of the presets")
    args = ap.parse_args()
    torch.set_num_threads(1)
    self_check()
    problems = []
    for name, model, batch, seq_len, seed in CASES:
        if args.only and name != args.only:
            continue
        before = len(problems)
        try:
            summary = check_case(args, name, model, batch, seq_len, seed, problems)
        except RuntimeError as e:
            problems.append("%s: %s" % (name, e))
            summary = None
        status = "ok" if len(problems) == before else "FAIL"
        print("%-16s %s  B=%d T=%d" % (name, status, batch, seq_len))
        for variant, s in (summary or {}).items():
            w = s["grad_worst"]
            print("  %-5s loss/token cpp %.6f | loss rel: cpp-t32 %.2e  cpp-t64 %.2e  t32-t64 %.2e"
                  % (variant, s["loss_cpp"] / s["tokens"],
                     s["loss_rel_cpp_t32"], s["loss_rel_cpp_t64"], s["loss_rel_t32_t64"]))
            print("        grads, all: cpp-t32 %.2e  cpp-t64 %.2e  t32-t64 %.2e   max|cpp-t32| %.2e"
                  % (s["grad_all_rel_cpp_t32"], s["grad_all_rel_cpp_t64"],
                     s["grad_all_rel_t32_t64"], s["grad_max_abs_cpp_t32"]))
            print("        grads, worst tensor: cpp-t32 %.2e (%s)  cpp-t64 %.2e (%s)"
                  "  t32-t64 %.2e (%s)" % (w["cpp_t32"] + w["cpp_t64"] + w["t32_t64"]))
            print("        deterministic; ||accumulated - 2g|| / ||2g|| = %.2e"
                  % s["accumulate_rel"])
            if "ref_loss_rel_t64" in s:
                print("        fp64 oracle vs torch64: loss rel %.2e, worst grad %.2e (%s)"
                      % ((s["ref_loss_rel_t64"],) + s["ref_worst_t64"]))
        for p in problems[before:]:
            print("  " + p)
    if problems:
        print("FAILED: %d problem(s)" % len(problems))
        return 1
    print("all cases pass (norm-wise relative tolerance %.0e)" % REL_TOL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
