#!/usr/bin/python3
"""Writes DeepSpeed / Megatron-DeepSpeed ZeRO checkpoints in DeepSpeed's on-disk layout.

Run with Debian's python3 and python3-torch (torch 1.13); DeepSpeed is not needed:
    /usr/bin/python3 tools/make_deepspeed_fixtures.py tests/data/deepspeed
    /usr/bin/python3 tools/make_deepspeed_fixtures.py /tmp/ds_big --big   # benchmark size

The layout facts come from shared/reference/deepspeed_ucp.md sections 2-4. One seeded full model
(fp32 master weights and Adam exp_avg / exp_avg_sq at their logical, unpadded shapes under ucp's
canonical names) is saved as expected.pt; each layout folder is that model sharded the way
Megatron-DeepSpeed and DeepSpeed's ZeRO-1/2 or BF16 optimizers save it: TP slices (column
parallel on dim 0, row parallel on dim 1, fused QKV laid out per head so TP slices are whole
heads, vocabulary padded to a multiple of make_vocab_size_divisible_by * tp), one flat fp32
buffer per optimizer group padded to a multiple of 2 * dp and cut into dp partitions, with
param_slice_mappings of fragment_address(numel, start). Alignment padding is NaN (poisoned) so
that a reader that touches it is caught.

Name map (ucp canonical -> Megatron-DeepSpeed GPTModelPipe / GPTModel), with L layers:
    embedding.word_embeddings.weight      tied_modules.embed.word_embeddings.weight
                                          language_model.embedding.word_embeddings.weight
    embedding.position_embeddings.weight  tied_modules.embed.position_embeddings.weight
    layers.{i}.<rest>                     {i+2}.<rest> / language_model.encoder.layers.{i}.<rest>
    final_layernorm.{weight,bias}         {L+2}.{weight,bias} / language_model.encoder.final_...
Plain DeepSpeed naming uses the canonical names as the engine's parameter names.
"""

import argparse
import collections
import os
import random
import sys

import numpy as np
import torch


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixture_standins import LossScaler, ModelType, ZeroStageEnum, fragment_address  # noqa: E402,F401

LAYER_PARAMS = [  # (suffix, shape expr, kind): kind col = dim 0, row = dim 1, rep = replicated
    ("input_layernorm.weight", ("h",), "rep"),
    ("input_layernorm.bias", ("h",), "rep"),
    ("self_attention.query_key_value.weight", ("3h", "h"), "col"),
    ("self_attention.query_key_value.bias", ("3h",), "col"),
    ("self_attention.dense.weight", ("h", "h"), "row"),
    ("self_attention.dense.bias", ("h",), "rep"),
    ("post_attention_layernorm.weight", ("h",), "rep"),
    ("post_attention_layernorm.bias", ("h",), "rep"),
    ("mlp.dense_h_to_4h.weight", ("f", "h"), "col"),
    ("mlp.dense_h_to_4h.bias", ("f",), "col"),
    ("mlp.dense_4h_to_h.weight", ("h", "f"), "row"),
    ("mlp.dense_4h_to_h.bias", ("h",), "rep"),
]


class Model:
    def __init__(self, hidden, heads, layers, vocab, positions, divisible_by, seed):
        self.h, self.heads, self.layers = hidden, heads, layers
        self.vocab, self.positions, self.divisible_by = vocab, positions, divisible_by
        dims = {"h": hidden, "3h": 3 * hidden, "f": 4 * hidden}
        self.params = collections.OrderedDict()  # canonical name -> (shape, kind)
        self.params["embedding.word_embeddings.weight"] = ((vocab, hidden), "vocab")
        self.params["embedding.position_embeddings.weight"] = ((positions, hidden), "rep")
        for i in range(layers):
            for suffix, shape, kind in LAYER_PARAMS:
                self.params[f"layers.{i}.{suffix}"] = (tuple(dims[d] for d in shape), kind)
        self.params["final_layernorm.weight"] = ((hidden,), "rep")
        self.params["final_layernorm.bias"] = ((hidden,), "rep")
        self.pad_vocab = True  # Megatron pads the vocabulary; plain DeepSpeed models do not
        gen = torch.Generator().manual_seed(seed)
        self.full = {}
        for name, (shape, _) in self.params.items():
            self.full[name] = {
                "fp32": torch.randn(shape, generator=gen),
                "exp_avg": torch.randn(shape, generator=gen) * 1e-3,
                "exp_avg_sq": torch.rand(shape, generator=gen) * 1e-6,
            }

    def padded_vocab(self, tp):
        m = self.divisible_by * tp
        return (self.vocab + m - 1) // m * m

    def tp_slice(self, name, state, tp, r, gen):
        shape, kind = self.params[name]
        t = self.full[name][state]
        if kind == "rep" or tp == 1 and kind != "vocab":
            return t.clone()
        if kind == "vocab":
            pad = self.padded_vocab(tp) - self.vocab if self.pad_vocab else 0
            junk = torch.randn((pad, shape[1]), generator=gen)  # padding rows: stripped by readers
            return torch.cat([t, junk]).chunk(tp, 0)[r].clone()
        dim = 1 if kind == "row" else 0
        return t.chunk(tp, dim)[r].clone()


def engine_name(model, canon, flavour):
    if flavour == "plain":
        return canon
    L = model.layers
    if flavour == "pipe":
        if canon.startswith("embedding."):
            return "tied_modules.embed." + canon[len("embedding."):]
        if canon.startswith("layers."):
            _, i, rest = canon.split(".", 2)
            return f"{int(i) + 2}.{rest}"
        return f"{L + 2}.{canon.split('.')[-1]}"
    if canon.startswith("embedding."):
        return "language_model." + canon
    if canon.startswith("layers."):
        return "language_model.encoder." + canon
    return "language_model.encoder." + canon


def stage_params(model, pp, stage):
    """Canonical names held by pipeline stage `stage`, in module order (tied embeddings first)."""
    per = model.layers // pp
    names = []
    if stage == 0 or stage == pp - 1:
        names += ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"]
    for i in range(stage * per, (stage + 1) * per):
        names += [f"layers.{i}.{s}" for s, _, _ in LAYER_PARAMS]
    if stage == pp - 1:
        names += ["final_layernorm.weight", "final_layernorm.bias"]
    return names


def rng_state():
    random.seed(5)
    np.random.seed(5)
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None,
             "rng_tracker_states": {}}]


def write_layout(out, model, tp, pp, dp, sp, lp, optimizer, flavour, meta_dims, seed):
    """optimizer: 'bf16' (BF16_Optimizer), 'zero1' or 'zero2' (DeepSpeedZeroOptimizer)."""
    tag = "global_step7"
    folder = os.path.join(out, tag)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(out, "latest"), "w") as f:
        f.write(tag)
    lp_dtype = torch.bfloat16 if lp == "bf16" else torch.float16
    model.pad_vocab = flavour != "plain"
    gen = torch.Generator().manual_seed(seed)
    nd = dp * sp
    iteration = 7
    ds_config = {"train_batch_size": 8 * dp, "bf16": {"enabled": lp == "bf16"},
                 "fp16": {"enabled": lp == "fp16"},
                 "zero_optimization": {"stage": 2 if optimizer == "zero2" else 1}}
    args = argparse.Namespace(
        num_layers=model.layers, hidden_size=model.h, num_attention_heads=model.heads,
        ffn_hidden_size=4 * model.h, max_position_embeddings=model.positions, seq_length=16,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        ds_sequence_parallel_size=sp, make_vocab_size_divisible_by=model.divisible_by,
        padded_vocab_size=model.padded_vocab(tp), bf16=lp == "bf16", fp16=lp == "fp16",
        lr=3e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        iteration=iteration, deepspeed=True, zero_stage=1 if optimizer != "zero2" else 2)
    prefix = "bf16_" if lp == "bf16" else ""
    for s in range(pp):
        names = stage_params(model, pp, s)
        for r in range(tp):
            mp = s * tp + r if flavour == "pipe" else r
            slices = {n: {st: model.tp_slice(n, st, tp, r, gen) for st in ("fp32", "exp_avg",
                                                                         "exp_avg_sq")}
                      for n in names}
            groups = [[n for n in names if not n.endswith(".bias") and len(model.params[n][0]) >= 2],
                      [n for n in names if n.endswith(".bias") or len(model.params[n][0]) < 2]]
            param_shapes = [collections.OrderedDict(
                (engine_name(model, n, flavour), torch.Size(slices[n]["fp32"].shape)) for n in g)
                for g in groups]
            # Flat groups: concatenated and NaN-padded to a multiple of 2 * nd.
            flat = []
            for g in groups:
                parts = {st: torch.cat([slices[n][st].reshape(-1) for n in g])
                         for st in ("fp32", "exp_avg", "exp_avg_sq")}
                n = parts["fp32"].numel()
                aligned = (n + 2 * nd - 1) // (2 * nd) * (2 * nd)
                for st in parts:
                    parts[st] = torch.cat([parts[st], torch.full((aligned - n,), float("nan"))])
                offsets, o = [], 0
                for name in g:
                    offsets.append((name, o, slices[name]["fp32"].numel()))
                    o += slices[name]["fp32"].numel()
                flat.append((parts, n, aligned, offsets))
            model_states = collections.OrderedDict()
            if flavour == "pipe":
                model_states["module"] = None
            else:
                model_states["module"] = collections.OrderedDict(
                    (engine_name(model, n, flavour), slices[n]["fp32"].to(lp_dtype)) for n in names)
            model_states.update(
                buffer_names=[], optimizer=None, param_shapes=param_shapes,
                frozen_param_shapes=None, frozen_param_fragments=None, shared_params={},
                lr_scheduler={"num_steps": iteration}, data_sampler=None, random_ltd=None,
                sparse_tensor_module_names=set(), skipped_steps=0, global_steps=iteration,
                global_samples=iteration * 8 * dp, dp_world_size=nd, mp_world_size=tp * pp)
            if meta_dims:
                model_states["checkpoint_parallel_dimensions"] = {"pp_degree": pp, "tp_degree": tp}
            model_states.update(ds_config=ds_config, ds_version="0.16.9")
            if flavour != "plain":
                uci = {"universal_checkpoint_version": 0.3, "original_vocab_size": model.vocab,
                       "padded_vocab_size": model.padded_vocab(tp),
                       "vocabulary_parameter_patterns": [r"tied_modules.embed.word_embeddings.weight"]}
                if tp > 1:  # as Megatron-DeepSpeed: row-parallel rules only when saved at tp > 1
                    uci["parameter_with_row_parallelism_patterns"] = [
                        r"\d+.mlp.dense_4h_to_h.weight", r"\d+.self_attention.dense.weight"]
                model_states.update(args=args, checkpoint_version=3.0, iteration=iteration,
                                    tokens=iteration * 128, universal_checkpoint_info=uci,
                                    rng_state=rng_state())
            torch.save(model_states, os.path.join(folder, f"mp_rank_{mp:02d}_model_states.pt"))
            if flavour == "pipe":
                write_layer_files(folder, model, pp, s, r, slices, lp_dtype)
            for d in range(nd):
                write_optim(folder, prefix, d, mp, flat, optimizer, nd, ds_config, flavour, model,
                            iteration)


def write_layer_files(folder, model, pp, s, r, slices, lp_dtype):
    L = model.layers
    per = L // pp
    layers = {}
    if s == 0:
        layers[1] = {k: slices["embedding." + k]["fp32"] for k in
                     ("word_embeddings.weight", "position_embeddings.weight")}
    for i in range(s * per, (s + 1) * per):
        layers[i + 2] = {suf: slices[f"layers.{i}.{suf}"]["fp32"] for suf, _, _ in LAYER_PARAMS}
    if s == pp - 1:
        layers[L + 2] = {"weight": slices["final_layernorm.weight"]["fp32"],
                         "bias": slices["final_layernorm.bias"]["fp32"]}
    for idx, sd in layers.items():
        sd = collections.OrderedDict((k, v.to(lp_dtype)) for k, v in sd.items())
        torch.save(sd, os.path.join(folder, f"layer_{idx:02d}-model_{r:02d}-model_states.pt"))


def write_optim(folder, prefix, d, mp, flat, optimizer, nd, ds_config, flavour, model, iteration):
    fp32_groups, states, mappings, paddings, param_groups = [], {}, [], [], []
    for g, (parts, n, aligned, offsets) in enumerate(flat):
        P = aligned // nd
        lo, hi = d * P, (d + 1) * P
        pad_here = max(0, hi - max(lo, n))
        part = parts["fp32"][lo:hi].clone()
        if optimizer == "bf16":
            fp32_groups.append(part)
            paddings.append(aligned - n if d == nd - 1 else 0)
        else:
            fp32_groups.append(part[:P - pad_here])  # a view: the file keeps the padded storage
            paddings.append(pad_here)
        states[g] = {"step": torch.tensor(float(iteration)),
                     "exp_avg": parts["exp_avg"][lo:hi].clone(),
                     "exp_avg_sq": parts["exp_avg_sq"][lo:hi].clone()}
        m = collections.OrderedDict()
        for name, o, num in offsets:
            a, b = max(o, lo), min(o + num, hi)
            if a < b:
                m[engine_name(model, name, flavour)] = fragment_address(numel=b - a, start=a - lo)
        mappings.append(m)
        param_groups.append({"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8,
                             "weight_decay": 0.1 if g == 0 else 0.0, "amsgrad": False,
                             "params": [g]})
    base = {"state": states, "param_groups": param_groups}
    if optimizer == "bf16":
        osd = collections.OrderedDict(
            clip_grad=1.0, base_optimizer_state=base, single_partition_of_fp32_groups=fp32_groups,
            group_paddings=paddings, partition_count=[nd] * len(flat), ds_version="0.16.9",
            param_slice_mappings=mappings)
    else:
        osd = collections.OrderedDict(
            loss_scaler=LossScaler(65536.0), dynamic_loss_scale=True, overflow=False,
            clip_grad=1.0, base_optimizer_state=base,
            single_partition_of_fp32_groups=fp32_groups,
            zero_stage=ZeroStageEnum(2 if optimizer == "zero2" else 1), group_paddings=paddings,
            partition_count=[nd] * len(flat), ds_version="0.16.9", param_slice_mappings=mappings)
    torch.save({"optimizer_state_dict": osd, "ds_config": ds_config, "ds_version": "0.16.9"},
               os.path.join(folder, f"{prefix}zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt"))


def save_expected(path, model):
    torch.save(collections.OrderedDict(
        (n, collections.OrderedDict((s, model.full[n][s]) for s in ("fp32", "exp_avg",
                                                                  "exp_avg_sq")))
        for n in model.params), path)


# name: (tp, pp, dp, sp, low precision, optimizer, naming flavour, checkpoint_parallel_dimensions)
LAYOUTS = {
    "megatron_tp2_pp1_dp2_bf16": (2, 1, 2, 1, "bf16", "bf16", "gpt", True),
    "megatron_tp1_pp2_dp2_bf16": (1, 2, 2, 1, "bf16", "bf16", "pipe", False),
    "megatron_tp2_pp2_sp2_fp16_zero1": (2, 2, 1, 2, "fp16", "zero1", "pipe", True),
    "deepspeed_tp1_pp1_dp4_fp16_zero2": (1, 1, 4, 1, "fp16", "zero2", "plain", False),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--big", action="store_true",
                   help="GPT-2-small-sized tp=2,pp=2,dp=2 bf16 checkpoint for the benchmark")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.big:
        model = Model(768, 12, 6, 50257, 1024, 128, seed=11)
        write_layout(os.path.join(a.out, "gpt2_tp2_pp2_dp2_bf16"), model, 2, 2, 2, 1, "bf16",
                     "bf16", "pipe", True, seed=12)
        save_expected(os.path.join(a.out, "expected.pt"), model)
        return
    model = Model(16, 4, 2, 50, 16, 8, seed=7)
    save_expected(os.path.join(a.out, "expected.pt"), model)
    for i, (name, spec) in enumerate(LAYOUTS.items()):
        write_layout(os.path.join(a.out, name), model, *spec, seed=100 + i)


if __name__ == "__main__":
    main()
