"""Hugging Face peer test helper (docs/hf.md): the real transformers 4.47.1 and safetensors 0.4.5
(the venv of tools/setup_peers.sh) against ucp's `--format hf`.

  make  --case C --out DIR        a tiny random model of case C saved by save_pretrained into
                                  DIR/orig (its logits on fixed ids in DIR/logits.pt)
  check --case C --dir DIR --exported E
                                  transformers loads E (fp32): every tensor and model(ids).logits
                                  bitwise equal to DIR/orig's; when the original is sharded, ucp's
                                  index is transformers' own (same shards, same total_size)

  tp-qkv --case C --dir DIR       ucp's per-rank fused QKV slices in DIR/dist (any tp, also above
                                  the KV heads) are Megatron-Core's, and its attention input from
                                  them equals transformers' q/k/v projections

  megatron --data D --fixture F --exported E --state model|fp32|bf16
                                  the Megatron-DeepSpeed fixture D/F exported to HF as E: its
                                  logits in transformers against the PyTorch reference
                                  (tests/engine/torch_ref.py) over the generator's own weights;
                                  --rotary interleaved: the reference rotates pairs (2i, 2i+1);
                                  --wrong E2: E2's logits must be far from the reference's
  set-rotary-interleaved --dir D  args.rotary_interleaved = True in a fixture copy's files
  same-slices --a A --b B         ucp checkpoints A and B hold bitwise the same model slices

Cases (see CASES): GPT-2 (tied, Conv1D + c_attn), GPT-2 keys without the `transformer.` prefix
and with the legacy attn.bias / masked_bias buffers, GPT-2 with vocab 50257 (tp=4 pads to 50688),
Llama GQA nh=8 nkv=2 untied, Llama GQA tied with head_dim != hidden/heads, Llama MQA (nkv=1),
Llama keys without the `model.` prefix, Qwen2 (q/k/v biases, GQA), Mixtral (4 experts, top-2, GQA), and a sharded Llama
whose embedding is larger than the shard size.
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

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
    "llama-mqa": dict(arch="llama", cfg=dict(vocab_size=1000, hidden_size=64, intermediate_size=96,
                                             num_hidden_layers=4, num_attention_heads=4,
                                             num_key_value_heads=1, max_position_embeddings=64,
                                             tie_word_embeddings=False)),
    # Tied: transformers 4.47.1 refuses a prefix-less file that also holds lm_head.weight ("The
    # state dictionary of the model you are trying to load is corrupted").
    "llama-noprefix": dict(arch="llama", strip_prefix=True,
                           cfg=dict(vocab_size=1000, hidden_size=64, intermediate_size=96,
                                    num_hidden_layers=2, num_attention_heads=8,
                                    num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=True)),
    "qwen2": dict(arch="qwen2", cfg=dict(vocab_size=1000, hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=4, num_attention_heads=8,
                                         num_key_value_heads=2, max_position_embeddings=64,
                                         tie_word_embeddings=False)),
    "mixtral": dict(arch="mixtral", cfg=dict(vocab_size=500, hidden_size=64, intermediate_size=48,
                                             num_hidden_layers=2, num_attention_heads=8,
                                             num_key_value_heads=2, num_local_experts=4,
                                             num_experts_per_tok=2, max_position_embeddings=64,
                                             tie_word_embeddings=False)),
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
    elif spec["arch"] == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**spec["cfg"]))
    elif spec["arch"] == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**spec["cfg"]))
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
        # The hub's GPT-2 files: keys without `transformer.` (Llama: without `model.`), plus the
        # old causal-mask buffers.
        path = os.path.join(orig, "model.safetensors")
        sd = load_file(path)
        prefix = model.base_model_prefix + "."
        out = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in sd.items()}
        assert any(k != o for k, o in zip(sorted(sd), sorted(out))), "no prefix to strip"
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


# ---------------------------------------------------------------------------------------------
# Megatron-Core's fused QKV at ucp's layout, against transformers' q/k/v projections


def dist_tensors(dist, needle):
    """Every model-slice dataset of ucp's distributed checkpoint DIST whose name holds NEEDLE,
    as fp32 torch tensors, by dataset name (docs/distributed_format.md)."""
    import h5py
    import numpy as np
    out = {}
    for f in sorted(os.listdir(dist)):
        if not f.endswith(".h5"):
            continue
        with h5py.File(os.path.join(dist, f), "r") as h:
            def visit(name, obj):
                if not isinstance(obj, h5py.Dataset) or needle not in name or "/model/" not in name:
                    return
                kind = obj.attrs["dtype"]
                kind = kind.decode() if isinstance(kind, bytes) else str(kind)
                arr = obj[()]
                if kind == "bf16":  # raw bits: the high half of an fp32
                    t = torch.from_numpy(arr.astype(np.int32) << 16).view(torch.float32)
                else:
                    assert kind == "fp32", (name, kind)
                    t = torch.from_numpy(np.ascontiguousarray(arr))
                out[name] = t
            h.visititems(visit)
    return out


def tp_qkv(a):
    """ucp's per-rank linear_qkv slices (weight, Qwen2's bias) in DIR/dist are Megatron-Core's:
    (1) rank r's rows are chunk r of the per-group interleaved [q heads | k | v] tensor built here
    from transformers' q_proj/k_proj/v_proj, bitwise; (2) Megatron-Core's
    get_query_key_value_tensors, transcribed (fp64), turns each rank's slice into that rank's
    nh/tp query heads and its group's k and v, equal to transformers' projections of the same x.
    With tp above the KV heads this is the split that cuts inside a group (PR #2565)."""
    with open(os.path.join(a.dir, "dist", "ucp_layout.json")) as f:
        meta = json.load(f)
    lay = dict(kv.split("=") for kv in meta["layout"].split(","))
    tp, pp = int(lay["tp"]), int(lay["pp"])
    model = AutoModelForCausalLM.from_pretrained(os.path.join(a.dir, "orig"),
                                                 torch_dtype=torch.float32).eval()
    cfg = model.config
    nh, ng, hidden = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
    hd = getattr(cfg, "head_dim", None) or hidden // nh
    layers = model.model.layers
    per_stage = len(layers) // pp
    slices = dist_tensors(os.path.join(a.dir, "dist"), "self_attention.query_key_value.")
    g = torch.Generator().manual_seed(11)
    x = torch.randn(TOKENS, hidden, generator=g, dtype=torch.float64)
    rows_checked = 0
    for i, layer in enumerate(layers):
        att = layer.self_attn
        name = f"layers.{i % per_stage}.self_attention.query_key_value"
        for kind in ("weight", "bias"):
            q, k, v = (getattr(getattr(att, n), kind) for n in ("q_proj", "k_proj", "v_proj"))
            got = [slices.get(f"pp{i // per_stage}.tp{r}/model/{name}.{kind}") for r in range(tp)]
            if q is None:
                assert all(t is None for t in got), f"layer {i}: ucp holds a {kind} HF has not"
                continue
            assert all(t is not None for t in got), f"layer {i} {kind}: a tp slice is missing"
            tail = q.shape[1:]
            fused = torch.cat([q.reshape(ng, nh // ng * hd, *tail), k.reshape(ng, hd, *tail),
                               v.reshape(ng, hd, *tail)], dim=1).reshape(-1, *tail)
            for r, (want, have) in enumerate(zip(fused.chunk(tp), got)):
                assert torch.equal(want, have), f"layer {i} {kind}: tp rank {r}'s rows differ"
                rows_checked += have.shape[0]
        # Megatron-Core's forward on the slices (attention.py, get_query_key_value_tensors).
        def proj(w, b):
            y = x @ w.double().T
            return y if b is None else y + b.double()
        mixed = [proj(slices[f"pp{i // per_stage}.tp{r}/model/{name}.weight"],
                      slices.get(f"pp{i // per_stage}.tp{r}/model/{name}.bias")) for r in range(tp)]
        q_ref = proj(att.q_proj.weight, att.q_proj.bias).view(TOKENS, nh, hd)
        k_ref = proj(att.k_proj.weight, att.k_proj.bias).view(TOKENS, ng, hd)
        v_ref = proj(att.v_proj.weight, att.v_proj.bias).view(TOKENS, ng, hd)
        for r in range(tp):
            m = mixed[r]
            if ng < tp:
                share = tp // ng  # ranks per group: all-gather, then take this rank's group
                full = torch.cat(mixed, dim=-1)
                size = full.shape[-1] // ng
                m = full[:, (r // share) * size:(r // share + 1) * size]
                groups, heads = 1, nh // ng
            else:
                groups, heads = ng // tp, nh // tp
            m = m.reshape(TOKENS, groups, (heads // groups + 2) * hd)
            qq, kk, vv = torch.split(m, [heads // groups * hd, hd, hd], dim=2)
            qq = qq.reshape(TOKENS, -1, hd)
            if ng < tp:
                per = heads // share
                qq = qq[:, (r % share) * per:(r % share + 1) * per]
            first_group = r // share if ng < tp else r * groups
            for t, ref in ((qq, q_ref[:, r * (nh // tp):(r + 1) * (nh // tp)]),
                           (kk, k_ref[:, first_group:first_group + groups]),
                           (vv, v_ref[:, first_group:first_group + groups])):
                assert t.shape == ref.shape, (i, r, t.shape, ref.shape)
                assert torch.allclose(t, ref, rtol=0, atol=1e-12), (i, r, (t - ref).abs().max())
    print(f"{a.case} at {meta['layout']}: nh={nh} nkv={ng} head_dim={hd}: every tp rank's "
          f"linear_qkv rows ({rows_checked} in all) are Megatron-Core's contiguous 1/tp of the "
          f"per-group [q | k | v] rows, and its attention input (q heads of the rank, k and v of "
          f"the group) equals transformers' projections; a KV-replicating layout would hold "
          f"{(nh // tp + 2) * hd if ng < tp else (nh + 2 * ng) * hd // tp} rows per rank, "
          f"Megatron-Core's holds {(nh + 2 * ng) * hd // tp}")


# ---------------------------------------------------------------------------------------------
# A Megatron-DeepSpeed fixture exported to HF against the PyTorch reference

# Each Megatron fixture of tests/data/deepspeed and the generator's truth it was written from
# (tools/make_deepspeed_fixtures.py: fp32 masters and the weights as torch rounds them to bf16 /
# fp16); the reference reads the truth, never ucp.
FIXTURE_TRUTH = {
    "megatron_tp2_pp1_dp2_bf16": "expected.pt",
    "megatron_tp1_pp2_dp2_bf16": "expected.pt",
    "megatron_tp2_pp2_sp2_fp16_zero1": "expected.pt",
    "megatron_llama_tp2_pp2_dp2_bf16": "expected_llama.pt",
    "megatron_llama_tp2_pp1_dp2_fp16_zero1": "expected_llama.pt",
}


def megatron_args(folder):
    """The Megatron args a fixture's model states carry (Megatron's ModelType registered as the
    DeepSpeed peer test does, ds_peer.megatron_enums_importable)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ds_peer
    ds_peer.megatron_enums_importable()
    with open(os.path.join(folder, "latest")) as f:
        tag = os.path.join(folder, f.read().strip())
    return torch.load(os.path.join(tag, "mp_rank_00_model_states.pt"), map_location="cpu")["args"]


def reference_logits(torch_ref, p, cfg, ids):
    """torch_ref.forward_loss's forward up to the logits over the real vocabulary rows: the
    reference's own layer_norm / rms_norm / attention / mlp, unchanged."""
    gpt = cfg["family"] == "gpt"
    eps = cfg["norm_eps"]
    x = p["embedding.word_embeddings.weight"][ids]
    if gpt:
        x = x + p["embedding.position_embeddings.weight"][: ids.shape[1]][None]
    for i in range(cfg["layers"]):
        pre = "layers.%d." % i
        for norm, block in (("input_layernorm", torch_ref.attention),
                            ("post_attention_layernorm", torch_ref.mlp)):
            if gpt:
                h = torch_ref.layer_norm(x, p[pre + norm + ".weight"], p[pre + norm + ".bias"], eps)
            else:
                h = torch_ref.rms_norm(x, p[pre + norm + ".weight"], eps)
            x = x + block(h, p, pre, cfg)
    if gpt:
        x = torch_ref.layer_norm(x, p["final_layernorm.weight"], p["final_layernorm.bias"], eps)
    else:
        x = torch_ref.rms_norm(x, p["final_layernorm.weight"], eps)
    head = p["embedding.word_embeddings.weight"] if cfg["tied"] else p["output_layer.weight"]
    return x @ head[: cfg["vocab"]].t()


def hf_rms_norm(x, w, eps):
    """transformers 4.47.1's LlamaRMSNorm: computed in fp32 whatever the model's dtype."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def hf_rope_tables(seq_len, head_dim, theta, dtype):
    """transformers 4.47.1's LlamaRotaryEmbedding: inverse frequencies, angles and cos/sin in
    fp32 whatever the model's dtype, then cast (torch_ref rounds fp64 angles once)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    ang = (inv_freq[:, None] @ torch.arange(seq_len).float()[None, :]).t()
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope_interleaved(x, cos, sin):
    """Interleaved rotary (GPT-J, Meta's LLaMA, Megatron --rotary-interleaved): element pairs
    (2i, 2i+1) rotated by pair i's angle, the elementwise operations of torch_ref.apply_rope
    (x*cos + rot*sin) on the other pairing; cos/sin are torch_ref's [T, D] tables whose halves
    repeat the D/2 angles."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * c + (-x1) * s, x1 * c + x0 * s], dim=-1).flatten(-2)


def same_slices(a):
    """Every model-slice dataset of ucp checkpoints A and B: the same names, bitwise equal (the
    vocabulary-padded ones, names matching --padded, over their first --vocab rows of the whole
    tensor only: the pad rows' fill is each source's)."""
    import re
    x, y = dist_tensors(a.a, ""), dist_tensors(a.b, "")
    assert sorted(x) == sorted(y), (sorted(set(x) ^ set(y)))[:5]
    bad, padded = [], {}
    for n in sorted(x):
        if a.padded and re.search(a.padded, n):
            # The tp ranks' rows in order (names sort by rank below 10), then the real rows.
            padded.setdefault(re.sub(r"tp\d+", "tp*", n), []).append(n)
        elif not torch.equal(x[n], y[n]):
            bad.append(n)
    for group, names in padded.items():
        whole = [torch.cat([t[n] for n in names])[: a.vocab] for t in (x, y)]
        assert whole[0].shape[0] == a.vocab, (group, whole[0].shape)
        if not torch.equal(*whole):
            bad.append(group)
    assert not bad, bad[:5]
    assert any("query_key_value" in n for n in x), sorted(x)[:5]
    print(f"{len(x)} model slices bitwise equal ({a.a} and {a.b}; {sorted(padded)} over their "
          f"{a.vocab} real rows)")


def set_rotary_interleaved(a):
    """A copy of a Megatron fixture as Megatron --rotary-interleaved would have saved it: every
    model-states file's args.rotary_interleaved = True (the weights unchanged: random weights
    are as much an interleaved model as a half-split one; the reference decides the pairing)."""
    megatron_args(a.dir)  # registers Megatron's enums for the unpickler
    with open(os.path.join(a.dir, "latest")) as f:
        tag = os.path.join(a.dir, f.read().strip())
    n = 0
    for name in sorted(os.listdir(tag)):
        if name.endswith("_model_states.pt"):
            path = os.path.join(tag, name)
            sd = torch.load(path, map_location="cpu")
            sd["args"].rotary_interleaved = True
            torch.save(sd, path)
            n += 1
    assert n > 0, tag
    print(f"args.rotary_interleaved = True in {n} model-states files of {tag}")


class Fp32Softmax:
    """torch for torch_ref.attention, with transformers 4.47.1's LlamaAttention softmax: in fp32
    whatever the model's dtype (eager attention)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def softmax(x, dim):
        return torch.softmax(x, dim=dim, dtype=torch.float32).to(x.dtype)


def miswire(model, cfg):
    """The mistake a wrong fused-layout reading makes, applied to the loaded HF model's layer 0 in
    place (the control: the comparison must see it). GPT: Megatron's per-head [q_h; k_h; v_h]
    rows taken as c_attn's [Q | K | V] thirds. LLaMA: the tp=2 fc1 [g0; u0; g1; u1] taken as
    [gate; up] (gate rows [g0; u0], up rows [g1; u1])."""
    with torch.no_grad():
        if cfg["family"] == "gpt":
            attn = model.transformer.h[0].attn.c_attn
            H, D = cfg["heads"], cfg["head_dim"]
            for t in (attn.weight, attn.bias):
                q, k, v = t.chunk(3, dim=-1)
                per_head = [torch.cat([q[..., h * D:(h + 1) * D], k[..., h * D:(h + 1) * D],
                                       v[..., h * D:(h + 1) * D]], dim=-1) for h in range(H)]
                t.copy_(torch.cat(per_head, dim=-1))
        else:
            mlp = model.model.layers[0].mlp
            g0, g1 = mlp.gate_proj.weight.clone().chunk(2, 0)
            u0, u1 = mlp.up_proj.weight.clone().chunk(2, 0)
            mlp.gate_proj.weight.copy_(torch.cat([g0, u0]))
            mlp.up_proj.weight.copy_(torch.cat([g1, u1]))


def megatron(a):
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(src, "tests", "engine"))
    import torch_ref
    folder = os.path.join(a.data, a.fixture)
    args = megatron_args(folder)
    truth = torch.load(os.path.join(a.data, FIXTURE_TRUTH[a.fixture]))
    family = "llama" if args.normalization == "rmsnorm" else "gpt"
    vocab = truth["embedding.word_embeddings.weight"]["fp32"].shape[0]
    hyper = {"hidden": args.hidden_size, "layers": args.num_layers,
             "heads": args.num_attention_heads,
             "kv_heads": getattr(args, "num_key_value_heads", args.num_attention_heads),
             "head_dim": getattr(args, "kv_channels", None) or
             args.hidden_size // args.num_attention_heads,
             "ffn_hidden": args.ffn_hidden_size, "vocab": vocab,
             "max_positions": args.max_position_embeddings,
             "tied_embeddings": not args.untie_embeddings_and_output_weights}
    cfg = torch_ref.config_from_hyper(family, hyper)
    # The exported weights: the training dtype's (what the model-state files hold), with
    # --dtype fp32 the fp32 masters, with --dtype bf16 the masters rounded to nearest even as
    # torch rounds them (the truth's model_bf16; from an fp16 run a cast ucp makes); each is
    # exact in fp32 and fp64.
    key = {"fp32": "fp32", "bf16": "model_bf16",
           "model": "model_bf16" if args.bf16 else "model_fp16"}[a.state]
    weights = {n: st[key] for n, st in truth.items()}

    model = AutoModelForCausalLM.from_pretrained(a.exported, torch_dtype=torch.float32).eval()
    want_dtype = weights[next(iter(weights))].dtype
    with open(os.path.join(a.exported, "config.json")) as f:
        torch_dtype = json.load(f)["torch_dtype"]
    assert torch_dtype == str(want_dtype).replace("torch.", ""), (torch_dtype, want_dtype)
    assert model.config.vocab_size == vocab, (model.config.vocab_size, vocab)
    # GPT: as many tokens as the learned positions; LLaMA: 40 (RoPE is the identity at distance 0).
    tokens = args.max_position_embeddings if family == "gpt" else TOKENS
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (3, tokens), generator=g)
    ids[0, :2] = torch.tensor([0, vocab - 1])  # the first and the last real vocabulary row

    with open(os.path.join(a.exported, "config.json")) as f:
        eps = json.load(f)["layer_norm_epsilon" if family == "gpt" else "rms_norm_eps"]
    assert eps == 1e-5, eps  # Megatron's default; the fixtures' args do not set another

    interleaved = a.rotary == "interleaved"
    assert family == "llama" or not interleaved, "GPT has no rotary embedding"

    def run(dtype, islands=False):
        """The reference's logits in `dtype`; with islands, at transformers' eps (1e-5 as a
        double, where the reference holds the engine's float 1e-5) and, for LLaMA, with
        transformers' fp32 computations inside an fp64 model (hf_rms_norm, hf_rope_tables,
        Fp32Softmax)."""
        p = {n: w.to(dtype) for n, w in weights.items()}
        c = dict(cfg, norm_eps=eps) if islands else cfg
        saved = (torch_ref.rms_norm, torch_ref.rope_tables, torch_ref.torch,
                 torch_ref.apply_rope)
        if islands and family == "llama":
            torch_ref.rms_norm, torch_ref.rope_tables = hf_rms_norm, hf_rope_tables
            torch_ref.torch = Fp32Softmax()
        if interleaved:
            torch_ref.apply_rope = apply_rope_interleaved
        try:
            with torch.no_grad():
                return reference_logits(torch_ref, p, c, ids)
        finally:
            (torch_ref.rms_norm, torch_ref.rope_tables, torch_ref.torch,
             torch_ref.apply_rope) = saved

    with torch.no_grad():
        hf32 = model(ids).logits
        hf64 = model.to(torch.float64)(ids).logits
    model.to(torch.float32)
    ref32, ref64, ref64i = run(torch.float32), run(torch.float64), run(torch.float64, True)
    d = lambda x, y: (x.double() - y.double()).abs().max().item()  # noqa: E731
    scale = ref64.abs().max().item()
    # The tolerance (docs/hf.md): transformers and the reference are the same math in different
    # op orders (addmm vs matmul + add, the attention mask's finfo.min vs -inf, LayerNorm's fused
    # kernel, pow vs x*x*x), so in fp32 each is a rounding away from the fp64 truth: transformers'
    # distance to it is held to 4x the fp32 reference's own. In fp64 the two agree to 1e-12 of
    # the largest logit once transformers' own fixed-precision choices are made on both sides.
    tol32 = 4 * d(ref32, ref64)
    tol64 = 1e-12 * scale
    # With interleaved rotary the reference's q.k sums a head's D products pair after pair where
    # transformers' sums the first halves then the second (its rows are the permuted ones), so
    # in fp64 the two agree to roundings (the same 1e-12 bound as GPT), not bitwise.
    print(f"{a.fixture} ({family}, {a.rotary} rotary, {a.state} weights, {tokens} tokens, "
          f"vocab {vocab}, "
          f"max |logit| {scale:.3g}):")
    print(f"  transformers fp32 vs reference fp32: max |d| {d(hf32, ref32):.3g}"
          f"{' (bitwise)' if torch.equal(hf32, ref32) else ''}")
    print(f"  vs the reference in fp64: transformers fp32 {d(hf32, ref64):.3g}, reference fp32 "
          f"{d(ref32, ref64):.3g} (tolerance {tol32:.3g}), transformers fp64 {d(hf64, ref64):.3g}")
    print(f"  transformers fp64 vs reference fp64 at eps 1e-5"
          f"{' with fp32 RMSNorm, RoPE tables and softmax' if family == 'llama' else ''}: max |d| "
          f"{d(hf64, ref64i):.3g}{' (bitwise)' if torch.equal(hf64, ref64i) else ''} "
          f"(tolerance {tol64:.3g})")
    ok = d(hf32, ref64) <= tol32 and d(hf64, ref64i) <= tol64
    print(f"  {'ok' if ok else 'TOLERANCE EXCEEDED'}")
    if a.wrong:
        # The same weights exported with the other rotary setting: transformers must see it.
        other = AutoModelForCausalLM.from_pretrained(a.wrong, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            w = other(ids).logits
        print(f"  control, {a.wrong} (the other rotary setting): max |d| {d(w, ref64):.3g} "
              f"({d(w, ref64) / tol32:.3g}x the fp32 tolerance)")
        assert d(w, ref64) > 100 * tol32, "the comparison cannot tell the rotary setting"
    miswire(model, cfg)
    with torch.no_grad():
        wrong = model(ids).logits
    what = ("per-head QKV read as [Q|K|V]" if family == "gpt"
            else "tp=2 [g0;u0;g1;u1] read as [gate;up]")
    print(f"  control, {what} in layer 0: max |d| {d(wrong, ref64):.3g} "
          f"({d(wrong, ref64) / tol32:.3g}x the fp32 tolerance)")
    assert d(wrong, ref64) > 100 * tol32, "the comparison cannot tell a miswired layer"
    if not ok:
        sys.exit(1)


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
    t = sub.add_parser("tp-qkv")
    t.add_argument("--case", required=True, choices=sorted(CASES))
    t.add_argument("--dir", required=True)
    g = sub.add_parser("megatron")
    g.add_argument("--data", required=True)
    g.add_argument("--fixture", required=True, choices=sorted(FIXTURE_TRUTH))
    g.add_argument("--exported", required=True)
    g.add_argument("--state", required=True, choices=["model", "fp32", "bf16"])
    g.add_argument("--rotary", default="half-split", choices=["half-split", "interleaved"],
                   help="the reference's rotary pairing")
    g.add_argument("--wrong", default="", help="an export with the other rotary setting, whose "
                   "logits must differ visibly")
    r = sub.add_parser("set-rotary-interleaved")
    r.add_argument("--dir", required=True)
    s = sub.add_parser("same-slices")
    s.add_argument("--a", required=True)
    s.add_argument("--b", required=True)
    s.add_argument("--padded", default="", help="regex of vocabulary-padded datasets")
    s.add_argument("--vocab", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)  # one summation order for both sides
    {"make": make, "check": check, "tp-qkv": tp_qkv, "megatron": megatron,
     "set-rotary-interleaved": set_rotary_interleaved, "same-slices": same_slices}[a.cmd](a)


if __name__ == "__main__":
    main()
