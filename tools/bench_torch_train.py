#!/usr/bin/env python3
"""PyTorch training the same model on the same threads, for `ucp-bench train --torch` and
docs/PERFORMANCE.md ("Training step").

Builds the model of a ucp preset with the functional reference tests/engine/torch_ref.py (the
same math as the engine: fused Megatron QKV, tanh GeLU / SwiGLU, padded vocabulary), random
weights in fp32, and times forward + backward + torch.optim.AdamW (foreach where this torch
has it) on --batch x --seq random tokens with --threads intra-op threads. Prints
"tokens_per_s X", "step_s X" (the best of --steps after one warm-up step) and "peak_rss_mib X".
Exits 3 when torch is missing.
"""
import argparse
import json
import os
import resource
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", required=True, help="patterns/models/<name>.json")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("torch not installed", file=sys.stderr)
        return 3
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "tests", "engine"))
    import torch_ref  # noqa: E402

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with open(args.preset) as f:
        preset = json.load(f)
    cfg = torch_ref.config_from_hyper(preset["family"], preset["hyper"])
    params = torch_ref.param_names(cfg)
    # Shapes from the names (the engine's tp=1 shapes, vocabulary padded).
    C, F, D = cfg["hidden"], cfg["ffn_hidden"], cfg["head_dim"]
    H, G, Vp = cfg["heads"], cfg["kv_heads"], cfg["padded_vocab"]
    gpt = cfg["family"] == "gpt"

    def shape_of(n):
        if n.endswith("word_embeddings.weight") or n == "output_layer.weight":
            return (Vp, C)
        if n.endswith("position_embeddings.weight"):
            return (cfg["max_positions"], C)
        if "layernorm" in n:
            return (C,)
        if n.endswith("query_key_value.weight"):
            return ((H + 2 * G) * D, C)
        if n.endswith("query_key_value.bias"):
            return ((H + 2 * G) * D,)
        if n.endswith("self_attention.dense.weight"):
            return (C, H * D)
        if n.endswith("dense_h_to_4h.weight"):
            return ((F if gpt else 2 * F), C)
        if n.endswith("dense_h_to_4h.bias"):
            return (F,)
        if n.endswith("dense_4h_to_h.weight"):
            return (C, F)
        if n.endswith(".bias"):
            return (C,)
        raise ValueError(n)

    p = {n: (torch.randn(shape_of(n)) * 0.02).requires_grad_(True) for n in params}
    kw = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    try:
        opt = torch.optim.AdamW(list(p.values()), foreach=True, **kw)
    except TypeError:
        opt = torch.optim.AdamW(list(p.values()), **kw)
    B, T = args.batch, args.seq
    inputs = torch.randint(0, cfg["vocab"], (B, T))
    targets = torch.randint(0, cfg["vocab"], (B, T))
    best = float("inf")
    for i in range(args.steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch_ref.forward_loss(p, cfg, inputs, targets) / (B * T)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        if i > 0:
            best = min(best, dt)
    print("tokens_per_s %.1f" % (B * T / best))
    print("step_s %.4f" % best)
    print("peak_rss_mib %.1f" % (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
