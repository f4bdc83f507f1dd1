"""Helper of tools/bench_hf.sh (run with the peer venv's python: transformers 4.47.1 over Debian's
torch 1.13, tools/setup_peers.sh).

  make --out DIR [--dtype fp32|bf16]   GPT2LMHeadModel with gpt2-medium's config (24 layers,
                                       hidden 1024, 16 heads, vocab 50257, 1024 positions; 355M
                                       parameters) at random init, save_pretrained into DIR (one
                                       model.safetensors, transformers' default 5GB shard size).
                                       Without transformers (Debian's python3 with torch only):
                                       the same tensors, names, shapes and dtype written by this
                                       script (header order as the safetensors package sorts it),
                                       with a GPT-2 config.json; the values differ (not
                                       transformers' init), the sizes and layout do not
  roundtrip --src DIR --out DIR        what a Python user does without ucp: from_pretrained, then
                                       save_pretrained, then os.sync(); prints the time of each
  import                               imports torch and transformers only (the fixed start-up cost
                                       inside the round trip's time)
"""
import argparse
import os
import sys
import time


def make_without_transformers(torch, out, dtype):
    """The source of `make` where only torch is installed: the benchmark needs the bytes'
    size and layout, not transformers' initialisation."""
    import json
    import struct
    hidden, layers, heads, vocab, positions = 1024, 24, 16, 50257, 1024
    shapes = {"transformer.wte.weight": [vocab, hidden],
              "transformer.wpe.weight": [positions, hidden],
              "transformer.ln_f.weight": [hidden], "transformer.ln_f.bias": [hidden]}
    for i in range(layers):
        h = f"transformer.h.{i}."
        shapes.update({h + "ln_1.weight": [hidden], h + "ln_1.bias": [hidden],
                       h + "attn.c_attn.weight": [hidden, 3 * hidden],
                       h + "attn.c_attn.bias": [3 * hidden],
                       h + "attn.c_proj.weight": [hidden, hidden], h + "attn.c_proj.bias": [hidden],
                       h + "ln_2.weight": [hidden], h + "ln_2.bias": [hidden],
                       h + "mlp.c_fc.weight": [hidden, 4 * hidden],
                       h + "mlp.c_fc.bias": [4 * hidden],
                       h + "mlp.c_proj.weight": [4 * hidden, hidden],
                       h + "mlp.c_proj.bias": [hidden]})
    tdtype, code = (torch.float32, "F32") if dtype == "fp32" else (torch.bfloat16, "BF16")
    torch.manual_seed(0)
    header, offset, names = {"__metadata__": {"format": "pt"}}, 0, sorted(shapes)
    for n in names:
        size = torch.Size(shapes[n]).numel() * (4 if dtype == "fp32" else 2)
        header[n] = {"dtype": code, "shape": shapes[n], "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for n in names:
            t = torch.randn(shapes[n]) * 0.02
            f.write(t.to(tdtype).contiguous().view(torch.uint8).numpy().tobytes())
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": hidden,
              "n_layer": layers, "n_head": heads, "vocab_size": vocab, "n_positions": positions,
              "n_ctx": positions, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-05,
              "initializer_range": 0.02, "tie_word_embeddings": True,
              "torch_dtype": "float32" if dtype == "fp32" else "bfloat16"}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    n = sum(torch.Size(s).numel() for s in shapes.values())
    print(f"saved {out}: GPT2LMHeadModel tensors (no transformers: written by bench_hf.py), "
          f"{n / 1e6:.1f}M parameters, {dtype}")


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
    if a.cmd == "make":
        try:
            import transformers  # noqa: F401
        except ImportError:
            make_without_transformers(torch, a.out, a.dtype)
            return
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
