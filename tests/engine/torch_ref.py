"""PyTorch reference for the offload engine's models (offload/offload/model/model.h).

GPT-2 / Megatron GPT and LLaMA written as plain functions over a dict of canonical parameter
name -> tensor, exactly as the engine's math is specified (the comment block atop
offload/offload/model/model.cc), so that autograd gives the gradients the engine's hand-written
backward must match. Also: loading a ucp universal checkpoint with h5py (docs/format.md), the
tp=1 vocabulary padding the engine holds, and an AdamW + global-norm clipping + LR schedule
reference for multi-step comparisons.

Shapes: B batch, T sequence, C hidden, V vocab (Vp padded), H heads, G kv_heads (query groups),
D head_dim, F ffn_hidden.
"""

import json
import math
import os

import h5py
import numpy as np
import torch

# ---------------------------------------------------------------------------------------------
# Configuration and checkpoint loading


def config_from_hyper(family, hyper):
    """The engine's ModelConfig from a model's hyper-parameters (a preset's `hyper`)."""
    hidden = int(hyper["hidden"])
    heads = int(hyper["heads"])
    vocab = int(hyper["vocab"])
    div = int(hyper.get("make_vocab_size_divisible_by", 1)) or 1
    cfg = {
        "family": family,
        "vocab": vocab,
        "padded_vocab": (vocab + div - 1) // div * div,  # tp=1: multiple of divisible_by * 1
        "hidden": hidden,
        "layers": int(hyper["layers"]),
        "heads": heads,
        "kv_heads": int(hyper.get("kv_heads", heads)),
        "head_dim": int(hyper.get("head_dim", hidden // heads)),
        "ffn_hidden": int(hyper.get("ffn_hidden", 4 * hidden)),
        "max_positions": int(hyper.get("max_positions", 0)),
        "tied": bool(hyper.get("tied_embeddings", False)),
        # ModelConfig holds eps as a float: 1e-5f, ~2.5e-13 relative below 1e-5. fp32 rounds to it
        # anyway; the float64 run uses it too, so that it computes the engine's exact definition.
        "norm_eps": float(np.float32(1e-5)),
        "rope_theta": 10000.0,
    }
    if family not in ("gpt", "llama"):
        raise ValueError("unknown family %r" % family)
    if family == "gpt" and cfg["kv_heads"] != heads:
        raise ValueError("gpt: kv_heads %d != heads %d" % (cfg["kv_heads"], heads))
    if heads % cfg["kv_heads"]:
        raise ValueError("heads %d not divisible by kv_heads %d" % (heads, cfg["kv_heads"]))
    return cfg


def _read_dataset(ds):
    """A universal dataset as float32/float64 numpy, decoding bf16 bits (docs/format.md §4)."""
    dtype = ds.attrs["dtype"]
    if isinstance(dtype, bytes):
        dtype = dtype.decode()
    raw = ds[()]
    if dtype == "bf16":
        return (np.asarray(raw).astype("<u4") << 16).view("<f4")
    if dtype in ("fp32", "fp64", "fp16"):
        return np.asarray(raw, dtype=np.float64 if dtype == "fp64" else np.float32)
    raise ValueError("%s: unsupported dtype %s" % (ds.name, dtype))


def load_universal(ckpt_dir, state="fp32"):
    """Reads a universal checkpoint: (config, {name: float32 numpy, logical unpadded shape})."""
    with open(os.path.join(ckpt_dir, "manifest.json")) as f:
        manifest = json.load(f)
    ucp_model = manifest["client_state"]["ucp_model"]
    cfg = config_from_hyper(ucp_model["family"], ucp_model["hyper"])
    params = {}
    for p in manifest["params"]:
        with h5py.File(os.path.join(ckpt_dir, p["file"]), "r") as h5:
            arr = _read_dataset(h5[state]).astype(np.float32)
        if list(arr.shape) != list(p["shape"]):
            raise ValueError("%s: shape %s != manifest %s" % (p["name"], arr.shape, p["shape"]))
        params[p["name"]] = arr
    return cfg, params


def pad_vocab(cfg, params):
    """The tp=1 rank's view: embedding / output rows padded with zeros up to padded_vocab."""
    out = dict(params)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in out and out[name].shape[0] < cfg["padded_vocab"]:
            w = out[name]
            pad = np.zeros((cfg["padded_vocab"] - w.shape[0],) + w.shape[1:], dtype=w.dtype)
            out[name] = np.concatenate([w, pad], axis=0)
    return out


def param_names(cfg):
    """Canonical names in canonical order (patterns/<family>.json `parameters`, layers expanded)."""
    gpt = cfg["family"] == "gpt"
    names = ["embedding.word_embeddings.weight"]
    if gpt:
        names.append("embedding.position_embeddings.weight")
    for i in range(cfg["layers"]):
        pre = "layers.%d." % i
        layer = ["input_layernorm.weight"]
        layer += ["input_layernorm.bias"] if gpt else []
        layer += ["self_attention.query_key_value.weight"]
        layer += ["self_attention.query_key_value.bias"] if gpt else []
        layer += ["self_attention.dense.weight"]
        layer += ["self_attention.dense.bias"] if gpt else []
        layer += ["post_attention_layernorm.weight"]
        layer += ["post_attention_layernorm.bias"] if gpt else []
        layer += ["mlp.dense_h_to_4h.weight"]
        layer += ["mlp.dense_h_to_4h.bias"] if gpt else []
        layer += ["mlp.dense_4h_to_h.weight"]
        layer += ["mlp.dense_4h_to_h.bias"] if gpt else []
        names += [pre + n for n in layer]
    names.append("final_layernorm.weight")
    if gpt:
        names.append("final_layernorm.bias")
    if not cfg["tied"]:
        names.append("output_layer.weight")
    return names


# ---------------------------------------------------------------------------------------------
# The models (float32 or float64, whatever the parameter tensors are)


def layer_norm(x, w, b, eps):
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)  # biased, as torch / Megatron
    return (x - mean) / torch.sqrt(var + eps) * w + b


def rms_norm(x, w, eps):
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def rope_tables(seq_len, head_dim, theta, dtype):
    """cos, sin: [T, D], half-split layout (angles for pair (i, i + D/2) repeated)."""
    half = head_dim // 2
    # Angles in float64, then rounded once: the most accurate table either precision can hold.
    inv_freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / head_dim)
    ang = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [T, D/2]
    ang = torch.cat([ang, ang], dim=-1)
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


def apply_rope(x, cos, sin):
    """x: [B, H, T, D]; rotate_half: (x1, x2) -> (-x2, x1)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def split_qkv(qkv, cfg):
    """qkv: [B, T, (H + 2G) * D] in Megatron interleaved groups -> q [B,H,T,D], k, v [B,G,T,D]."""
    B, T, _ = qkv.shape
    H, G, D = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    per = H // G
    grouped = qkv.view(B, T, G, (per + 2) * D)
    q = grouped[..., : per * D].reshape(B, T, G * per, D)  # head h = g * per + j
    k = grouped[..., per * D : (per + 1) * D]
    v = grouped[..., (per + 1) * D :]
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def attention(h, p, pre, cfg):
    """Causal self-attention of the normalized input h [B, T, C] -> [B, T, C] (before residual)."""
    gpt = cfg["family"] == "gpt"
    B, T, _ = h.shape
    H, G, D = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    qkv = h @ p[pre + "self_attention.query_key_value.weight"].t()
    if gpt:
        qkv = qkv + p[pre + "self_attention.query_key_value.bias"]
    q, k, v = split_qkv(qkv, cfg)
    if not gpt:
        cos, sin = rope_tables(T, D, cfg["rope_theta"], h.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rep = H // G  # query head h reads kv group h // rep
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)  # [B, H, T, T]
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    a = torch.softmax(scores, dim=-1) @ v  # [B, H, T, D]
    a = a.transpose(1, 2).reshape(B, T, H * D)  # heads concatenated head after head
    out = a @ p[pre + "self_attention.dense.weight"].t()
    if gpt:
        out = out + p[pre + "self_attention.dense.bias"]
    return out


def mlp(h, p, pre, cfg):
    w1 = p[pre + "mlp.dense_h_to_4h.weight"]
    w2 = p[pre + "mlp.dense_4h_to_h.weight"]
    if cfg["family"] == "gpt":
        u = gelu_tanh(h @ w1.t() + p[pre + "mlp.dense_h_to_4h.bias"])
        return u @ w2.t() + p[pre + "mlp.dense_4h_to_h.bias"]
    F = cfg["ffn_hidden"]
    gu = h @ w1.t()
    gate, up = gu[..., :F], gu[..., F:]
    return (torch.nn.functional.silu(gate) * up) @ w2.t()


def forward_loss(p, cfg, inputs, targets):
    """Sum over positions with target >= 0 of the cross-entropy (natural log). inputs/targets:
    int64 [B, T]. p: name -> tensor with vocab rows padded (padded rows never enter softmax)."""
    gpt = cfg["family"] == "gpt"
    eps = cfg["norm_eps"]
    T = inputs.shape[1]
    wte = p["embedding.word_embeddings.weight"]
    x = wte[inputs]
    if gpt:
        x = x + p["embedding.position_embeddings.weight"][:T][None]
    for i in range(cfg["layers"]):
        pre = "layers.%d." % i
        if gpt:
            h = layer_norm(x, p[pre + "input_layernorm.weight"], p[pre + "input_layernorm.bias"],
                           eps)
        else:
            h = rms_norm(x, p[pre + "input_layernorm.weight"], eps)
        x = x + attention(h, p, pre, cfg)
        if gpt:
            h = layer_norm(x, p[pre + "post_attention_layernorm.weight"],
                           p[pre + "post_attention_layernorm.bias"], eps)
        else:
            h = rms_norm(x, p[pre + "post_attention_layernorm.weight"], eps)
        x = x + mlp(h, p, pre, cfg)
    if gpt:
        x = layer_norm(x, p["final_layernorm.weight"], p["final_layernorm.bias"], eps)
    else:
        x = rms_norm(x, p["final_layernorm.weight"], eps)
    head = wte if cfg["tied"] else p["output_layer.weight"]
    logits = x @ head[: cfg["vocab"]].t()  # [B, T, V]: only the real rows
    valid = targets >= 0
    return torch.nn.functional.cross_entropy(logits[valid], targets[valid], reduction="sum")


def loss_and_grads(params_np, cfg, inputs, targets, grad_scale, dtype=torch.float32):
    """Autograd of grad_scale * loss_sum. params_np: name -> numpy (padded). Returns
    (loss_sum as float, {name: numpy gradient of `dtype`})."""
    p = {n: torch.tensor(np.asarray(a), dtype=dtype, requires_grad=True)
         for n, a in params_np.items()}
    inp = torch.as_tensor(np.asarray(inputs), dtype=torch.int64)
    tgt = torch.as_tensor(np.asarray(targets), dtype=torch.int64)
    loss = forward_loss(p, cfg, inp, tgt)
    (loss * grad_scale).backward()
    grads = {n: (t.grad.detach().numpy() if t.grad is not None else np.zeros(t.shape))
             for n, t in p.items()}
    return float(loss.detach()), grads


# ---------------------------------------------------------------------------------------------
# The optimizer reference (multi-step comparisons)


def lr_at(step, lr, warmup, decay, min_lr, style="cosine"):
    """Learning rate of 1-based `step`: linear warmup over `warmup` steps to lr, then `style`
    ("cosine", "linear" or "constant") decay to min_lr over the next `decay` steps, then min_lr.
    The lead fixes the exact schedule; this is the parameterized placeholder."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if style == "constant" or decay <= 0:
        return lr
    t = min(1.0, (step - warmup) / decay)
    if style == "linear":
        return min_lr + (lr - min_lr) * (1.0 - t)
    if style == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))
    raise ValueError("unknown schedule %r" % style)


def clip_grads(grads, clip):
    """Global-norm clipping in float64: every gradient times min(1, clip / (norm + 1e-6)),
    as torch.nn.utils.clip_grad_norm_. Returns (clipped grads, the pre-clip global norm)."""
    norm = math.sqrt(sum(float(np.sum(np.asarray(g, np.float64) ** 2)) for g in grads.values()))
    coef = clip / (norm + 1e-6) if clip > 0 else 1.0
    if coef >= 1.0:
        return dict(grads), norm
    return {n: (np.asarray(g, np.float64) * coef).astype(np.asarray(g).dtype)
            for n, g in grads.items()}, norm


def default_no_decay(name):
    """Megatron's default: biases and norm weights get no weight decay."""
    return name.endswith(".bias") or "layernorm" in name


def adamw_step(params, grads, exp_avg, exp_avg_sq, step, lr, betas=(0.9, 0.999), eps=1e-8,
               weight_decay=0.0, no_decay=default_no_decay):
    """One AdamW step in float64, rounded to float32 once (offload/optim/adam_ref.cc's formula:
    p *= 1 - lr*wd; m, v moments; p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)).
    All dicts name -> float32 numpy; returns new (params, exp_avg, exp_avg_sq)."""
    b1, b2 = betas
    bias1 = 1.0 - b1 ** step
    bias2 = 1.0 - b2 ** step
    new_p, new_m, new_v = {}, {}, {}
    for n in params:
        p = np.asarray(params[n], np.float64)
        g = np.asarray(grads[n], np.float64)
        m = np.asarray(exp_avg[n], np.float64)
        v = np.asarray(exp_avg_sq[n], np.float64)
        wd = 0.0 if no_decay(n) else weight_decay
        p = p * (1.0 - lr * wd)
        m = b1 * m + (1.0 - b1) * g
        v = b2 * v + (1.0 - b2) * g * g
        p = p - (lr / bias1) * m / (np.sqrt(v) / math.sqrt(bias2) + eps)
        new_p[n], new_m[n], new_v[n] = (a.astype(np.float32) for a in (p, m, v))
    return new_p, new_m, new_v


def train_step(params, exp_avg, exp_avg_sq, step, cfg, inputs, targets, *, lr, warmup, decay,
               min_lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, clip=1.0,
               style="cosine", dtype=torch.float32):
    """Forward/backward of the mean loss over target tokens, clipping, schedule, AdamW.
    Returns (loss_sum, grad_norm, lr, params, exp_avg, exp_avg_sq)."""
    n_tok = int((np.asarray(targets) >= 0).sum())
    loss, grads = loss_and_grads(params, cfg, inputs, targets, 1.0 / max(n_tok, 1), dtype)
    grads, norm = clip_grads(grads, clip)
    step_lr = lr_at(step, lr, warmup, decay, min_lr, style)
    params, exp_avg, exp_avg_sq = adamw_step(params, grads, exp_avg, exp_avg_sq, step, step_lr,
                                             betas, eps, weight_decay)
    return loss, norm, step_lr, params, exp_avg, exp_avg_sq
