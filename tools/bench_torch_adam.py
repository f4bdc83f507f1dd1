#!/usr/bin/env python3
"""torch's AdamW on the CPU, for `ucp-bench adam --torch` and docs/PERFORMANCE.md ("CPU Adam").

Steps fp32 params of --params elements with torch.optim.AdamW (foreach=False and, where this
torch has it, foreach=True) using --threads intra-op threads, and prints one line per variant:
"NAME MPARAM_PER_S" (the best of --repeat steps after one warm-up step). Exits 3 when torch is
missing so the caller can say so.
"""
import argparse
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", type=int, default=64 << 20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--grad", choices=["fp32", "bf16", "fp16"], default="fp32",
                    help="gradient dtype; torch's AdamW needs grads of the param dtype, so "
                         "bf16/fp16 grads are cast to fp32 each step (timed)")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("torch not installed", file=sys.stderr)
        return 3
    torch.set_num_threads(args.threads)
    n = args.params
    variants = [("torch-adamw", {"foreach": False})]
    try:
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)], foreach=True)
        variants.append(("torch-adamw-foreach", {"foreach": True}))
    except TypeError:  # torch older than 1.12 has no foreach argument
        pass
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.grad)
    for name, kwargs in variants:
        p = torch.nn.Parameter(torch.randn(n) * 0.02)
        g_low = (torch.randn(n) * 1e-2).to(low) if low is not None else None
        p.grad = torch.randn(n) * 1e-2
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, **kwargs)
        best = float("inf")
        for r in range(args.repeat + 1):
            t0 = time.perf_counter()
            if g_low is not None:
                p.grad.copy_(g_low)
            opt.step()
            dt = time.perf_counter() - t0
            if r > 0:
                best = min(best, dt)
        print(f"{name} {n / best / 1e6:.1f}", flush=True)
        del opt, p, g_low
    return 0


if __name__ == "__main__":
    sys.exit(main())
