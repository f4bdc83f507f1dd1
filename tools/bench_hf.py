"""Helper of tools/bench_hf.sh (run with the peer venv's python: transformers 4.47.1 over Debian's
torch 1.13, tools/setup_peers.sh).

  make --out DIR [--dtype fp32|bf16]   GPT2LMHeadModel with gpt2-medium's config (24 layers,
                                       hidden 1024, 16 heads, vocab 50257, 1024 positions; 355M
                                       parameters) at random init, save_pretrained into DIR (one
                                       model.safetensors, transformers' default 5GB shard size)
  roundtrip --src DIR --out DIR        what a Python user does without ucp: from_pretrained, then
                                       save_pretrained, then os.sync(); prints the time of each
  import                               imports torch and transformers only (the fixed start-up cost
                                       inside the round trip's time)
"""
import argparse
import os
import sys
import time


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    m.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    r = sub.add_parser("roundtrip")
    r.add_argument("--src", required=True)
    r.add_argument("--out", required=True)
    sub.add_parser("import")
    a = p.parse_args()
    t0 = time.monotonic()
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
    t_import = time.monotonic() - t0
    if a.cmd == "import":
        print(f"import torch + transformers: {t_import:.2f} s")
        return
    if a.cmd == "make":
        torch.manual_seed(0)
        cfg = GPT2Config(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, n_positions=1024)
        model = GPT2LMHeadModel(cfg)
        if a.dtype == "bf16":
            model = model.to(torch.bfloat16)
        model.save_pretrained(a.out, safe_serialization=True)
        n = sum(t.numel() for t in model.parameters())
        print(f"saved {a.out}: GPT2LMHeadModel, {n / 1e6:.1f}M parameters, {a.dtype}")
        return
    t1 = time.monotonic()
    # torch_dtype="auto": the file's dtype, as a user converting a model keeps it.
    model = AutoModelForCausalLM.from_pretrained(a.src, torch_dtype="auto")
    t2 = time.monotonic()
    model.save_pretrained(a.out, safe_serialization=True)
    os.sync()
    t3 = time.monotonic()
    print(f"transformers: import {t_import:.2f} s, from_pretrained {t2 - t1:.2f} s, "
          f"save_pretrained + sync {t3 - t2:.2f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
