"""Hugging Face peer test helper (docs/hf.md): the real transformers 4.47.1 and safetensors 0.4.5
(the venv of tools/setup_peers.sh) against ucp's `--format hf`.

  make  --case C --out DIR        a tiny random model of case C saved by save_pretrained into
                                  DIR/orig (its logits on fixed ids in DIR/logits.pt)
  check --case C --dir DIR --exported E
                                  transformers loads E (fp32): every tensor and model(ids).logits
                                  bitwise equal to DIR/orig's; when the original is sharded, ucp's
                                  index is transformers' own (same shards, same total_size)

Cases (see CASES): GPT-2 (tied, Conv1D + c_attn), GPT-2 keys without the `transformer.` prefix
and with the legacy attn.bias / masked_bias buffers, GPT-2 with vocab 50257 (tp=4 pads to 50688),
Llama GQA nh=8 nkv=2 untied, Llama GQA tied with head_dim != hidden/heads, and a sharded Llama
whose embedding is larger than the shard size.
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

TOKENS = 40  # >= 32: RoPE is the identity at distance 0, so one token proves nothing

CASES = {
    "gpt2": dict(arch="gpt2", cfg=dict(vocab_size=1000, n_positions=64, n_embd=64, n_layer=4, n_head=8)),
    "gpt2-noprefix": dict(arch="gpt2", strip_prefix=True, legacy_buffers=True,
                          cfg=dict(vocab_size=777, n_positions=48, n_embd=32, n_layer=2, n_head=4)),
    "gpt2-vocab50257": dict(arch="gpt2", cfg=dict(vocab_size=50257, n_positions=64, n_embd=32,
                                                  n_layer=2, n_head=4)),
    "llama-gqa-untied": dict(arch="llama", cfg=dict(vocab_size=1000, hidden_size=64, intermediate_size=96,
                                                    num_hidden_layers=4, num_attention_heads=8,
                                                    num_key_value_heads=2, max_position_embeddings=64,
                                                    tie_word_embeddings=False, rms_norm_eps=1e-6,
                                                    rope_theta=10000.0)),
    "llama-gqa-tied-headdim": dict(arch="llama", cfg=dict(vocab_size=999, hidden_size=64, intermediate_size=80,
                                                          num_hidden_layers=2, num_attention_heads=8,
                                                          num_key_value_heads=2, head_dim=16,
                                                          max_position_embeddings=64,
                                                          tie_word_embeddings=True, rope_theta=500000.0)),
    "llama-sharded": dict(arch="llama", max_shard_size="60KB",
                          cfg=dict(vocab_size=1000, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, tie_word_embeddings=False)),
}


def build(case):
    spec = CASES[case]
    torch.manual_seed(1234)
    if spec["arch"] == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(**spec["cfg"]))
    else:
        model = LlamaForCausalLM(LlamaConfig(**spec["cfg"]))
    # Every weight random, norms and biases included, so a misplaced one changes the logits.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def ids_for(vocab):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (2, TOKENS), generator=g)


def logits_of(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids_for(model.config.vocab_size)).logits, model


def make(a):
    spec = CASES[a.case]
    orig = os.path.join(a.out, "orig")
    model = build(a.case)
    kw = {"max_shard_size": spec["max_shard_size"]} if "max_shard_size" in spec else {}
    model.save_pretrained(orig, safe_serialization=True, **kw)
    if spec.get("strip_prefix"):
        # The hub's GPT-2 files: keys without `transformer.`, plus the old causal-mask buffers.
        path = os.path.join(orig, "model.safetensors")
        sd = load_file(path)
        out = {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in sd.items()}
        if spec.get("legacy_buffers"):
            n = model.config.n_positions
            for i in range(model.config.n_layer):
                out[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
                out[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
        save_file(out, path, metadata={"format": "pt"})
    with torch.no_grad():
        direct = model(ids_for(model.config.vocab_size)).logits
    loaded, _ = logits_of(orig)
    assert torch.equal(direct, loaded), "transformers' own save/load changed the logits"
    torch.save(loaded, os.path.join(a.out, "logits.pt"))
    print(f"{a.case}: saved {orig} ({sorted(os.listdir(orig))})")


def check(a):
    orig = os.path.join(a.dir, "orig")
    want = torch.load(os.path.join(a.dir, "logits.pt"))
    got, model = logits_of(a.exported)
    _, ref = logits_of(orig)
    sd_ref, sd_got = ref.state_dict(), model.state_dict()
    assert sd_ref.keys() == sd_got.keys(), sorted(set(sd_ref) ^ set(sd_got))
    bad = [k for k in sd_ref if not torch.equal(sd_ref[k], sd_got[k])]
    assert not bad, f"tensors differ: {bad[:5]}"
    assert got.shape == want.shape and got.shape[1] >= 32, got.shape
    if not torch.equal(got, want):
        print(f"logits differ: max |d| = {(got - want).abs().max().item()}", file=sys.stderr)
        sys.exit(1)
    cfg_ref, cfg_got = ref.config.to_dict(), model.config.to_dict()
    for key in ("vocab_size", "tie_word_embeddings", "torch_dtype"):
        assert cfg_ref.get(key) == cfg_got.get(key), (key, cfg_ref.get(key), cfg_got.get(key))
    index = "model.safetensors.index.json"
    if os.path.exists(os.path.join(orig, index)):
        with open(os.path.join(orig, index)) as f:
            a_index = json.load(f)
        with open(os.path.join(a.exported, index)) as f:
            b_index = json.load(f)
        assert a_index["weight_map"] == b_index["weight_map"], "ucp's shards are not transformers'"
        assert a_index["metadata"]["total_size"] == b_index["metadata"]["total_size"]
        print(f"index: {len(set(b_index['weight_map'].values()))} shards, as save_pretrained cut them")
    print(f"{a.case}: {len(sd_ref)} tensors and logits {tuple(got.shape)} bitwise equal")


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--case", required=True, choices=sorted(CASES))
    m.add_argument("--out", required=True)
    c = sub.add_parser("check")
    c.add_argument("--case", required=True, choices=sorted(CASES))
    c.add_argument("--dir", required=True)
    c.add_argument("--exported", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)  # one summation order for both sides
    {"make": make, "check": check}[a.cmd](a)


if __name__ == "__main__":
    main()
