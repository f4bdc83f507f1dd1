#!/usr/bin/python3
"""Writes DeepSpeed / Megatron-DeepSpeed ZeRO checkpoints in DeepSpeed's on-disk layout.

Run with Debian's python3 and python3-torch (torch 1.13); DeepSpeed is not needed:
    /usr/bin/python3 tools/make_deepspeed_fixtures.py tests/data/deepspeed
    /usr/bin/python3 tools/make_deepspeed_fixtures.py /tmp/ds_big --big   # benchmark size

The layout facts come from shared/reference/deepspeed_ucp.md sections 2-5. One seeded full model
per family (fp32 master weights and Adam exp_avg / exp_avg_sq at their logical, unpadded shapes
under ucp's canonical names, plus the bf16 and fp16 weights torch rounds them to) is saved as the
truth: expected.pt (gpt), expected_llama.pt, expected_mixtral.pt. Each layout folder is that model
sharded the way Megatron-DeepSpeed and DeepSpeed's ZeRO-1/2 or BF16 optimizers save it: TP
slices (column parallel on dim 0, row parallel on dim 1, fused QKV laid out per query group so TP
slices are whole groups, SwiGLU's fused [gate; up] split per part and re-concatenated per rank,
vocabulary padded to a multiple of make_vocab_size_divisible_by * tp), the training-dtype
weights in `module` (GPTModel, plain) or in layer_XX-model_TT files (GPTModelPipe), and one flat
fp32 buffer per optimizer group padded to a multiple of 2 * dp and cut into dp partitions, with
param_slice_mappings of fragment_address(numel, start). Alignment padding and vocabulary padding
are poisoned (NaN / random) so that a reader that touches them is caught. The Megatron folders'
model states carry the universal_checkpoint_info Megatron-DeepSpeed writes for their args and
model class (universal_info), which DeepSpeed's ds_to_universal needs (tests/peer checks it reads
every folder back to the truth); the plain DeepSpeed folders carry none, as a plain client.

Families: gpt (LayerNorm with bias, learned positions, MHA, GELU MLP, tied), llama
(Megatron-DeepSpeed --swiglu --normalization rmsnorm --no-position-embedding
--untie-embeddings-and-output-weights with num_key_value_heads < heads), mixtral (plain DeepSpeed
training a Megatron-Core-named MoE: experts are ordinary parameters, one optimizer group).

Name map (ucp canonical -> Megatron-DeepSpeed GPTModelPipe / GPTModel), with L layers:
    embedding.word_embeddings.weight      tied_modules.embed.word_embeddings.weight (tied)
                                          1.word_embeddings.weight (untied)
                                          language_model.embedding.word_embeddings.weight
    embedding.position_embeddings.weight  tied_modules.embed.position_embeddings.weight
    layers.{i}.<rest>                     {i+2}.<rest> / language_model.encoder.layers.{i}.<rest>
    final_layernorm.{weight,bias}         {L+2}.{weight,bias} / language_model.encoder.final_...
    output_layer.weight                   {L+3}.lm_head.weight / language_model.output_layer.weight
Plain DeepSpeed naming uses the canonical names as the engine's parameter names.
"""

import argparse
import collections
import hashlib
import json
import os
import random
import sys

import numpy as np
import torch


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixture_standins import LossScaler, ModelType, ZeroStageEnum, fragment_address  # noqa: E402,F401

# The DeepSpeed release the files claim to come from (ds_version), and its
# UNIVERSAL_CHECKPOINT_VERSION_VALUE, which Megatron-DeepSpeed copies into
# universal_checkpoint_info: 0.2 up to DeepSpeed 0.19.1 (0.3 came with AutoEP in 0.19.2).
DS_VERSION = "0.16.9"
UNIVERSAL_CHECKPOINT_VERSION = 0.2

# (suffix, shape expr, kind): col = dim 0, row = dim 1, rep = replicated, vocab = padded dim 0,
# swiglu = [gate; up] on dim 0, each part split over tp.
GPT_LAYER = [
    ("input_layernorm.weight", ("h",), "rep"),
    ("input_layernorm.bias", ("h",), "rep"),
    ("self_attention.query_key_value.weight", ("qkv", "h"), "col"),
    ("self_attention.query_key_value.bias", ("qkv",), "col"),
    ("self_attention.dense.weight", ("h", "h"), "row"),
    ("self_attention.dense.bias", ("h",), "rep"),
    ("post_attention_layernorm.weight", ("h",), "rep"),
    ("post_attention_layernorm.bias", ("h",), "rep"),
    ("mlp.dense_h_to_4h.weight", ("f", "h"), "col"),
    ("mlp.dense_h_to_4h.bias", ("f",), "col"),
    ("mlp.dense_4h_to_h.weight", ("h", "f"), "row"),
    ("mlp.dense_4h_to_h.bias", ("h",), "rep"),
]
LLAMA_LAYER = [
    ("input_layernorm.weight", ("h",), "rep"),
    ("self_attention.query_key_value.weight", ("qkv", "h"), "col"),
    ("self_attention.dense.weight", ("h", "h"), "row"),
    ("post_attention_layernorm.weight", ("h",), "rep"),
    ("mlp.dense_h_to_4h.weight", ("2f", "h"), "swiglu"),
    ("mlp.dense_4h_to_h.weight", ("h", "f"), "row"),
]
MIXTRAL_LAYER = [
    ("input_layernorm.weight", ("h",), "rep"),
    ("self_attention.query_key_value.weight", ("qkv", "h"), "col"),
    ("self_attention.dense.weight", ("h", "h"), "row"),
    ("pre_mlp_layernorm.weight", ("h",), "rep"),
    ("mlp.router.weight", ("E", "h"), "rep"),
]
MIXTRAL_EXPERT = [
    ("linear_fc1.weight", ("2f", "h"), "swiglu"),
    ("linear_fc2.weight", ("h", "f"), "row"),
]


class Model:
    def __init__(self, family, hidden, heads, layers, vocab, positions, divisible_by, seed,
                 kv_heads=None, ffn=None, experts=0, optimizer="adam"):
        self.family, self.h, self.heads, self.layers = family, hidden, heads, layers
        self.kv_heads = kv_heads or heads
        self.ffn = ffn or 4 * hidden
        self.experts = experts
        self.vocab, self.positions, self.divisible_by = vocab, positions, divisible_by
        self.tied = family == "gpt"
        head_dim = hidden // heads
        dims = {"h": hidden, "qkv": (heads + 2 * self.kv_heads) * head_dim, "f": self.ffn,
                "2f": 2 * self.ffn, "E": experts}
        self.params = collections.OrderedDict()  # canonical name -> (shape, kind)
        self.params["embedding.word_embeddings.weight"] = ((vocab, hidden), "vocab")
        if family == "gpt":
            self.params["embedding.position_embeddings.weight"] = ((positions, hidden), "rep")
        layer = {"gpt": GPT_LAYER, "llama": LLAMA_LAYER, "mixtral": MIXTRAL_LAYER}[family]
        for i in range(layers):
            for suffix, shape, kind in layer:
                self.params[f"layers.{i}.{suffix}"] = (tuple(dims[d] for d in shape), kind)
            for e in range(experts):
                for suffix, shape, kind in MIXTRAL_EXPERT:
                    self.params[f"layers.{i}.mlp.experts.{e}.{suffix}"] = (
                        tuple(dims[d] for d in shape), kind)
        self.params["final_layernorm.weight"] = ((hidden,), "rep")
        if family == "gpt":
            self.params["final_layernorm.bias"] = ((hidden,), "rep")
        if not self.tied:
            self.params["output_layer.weight"] = ((vocab, hidden), "vocab")
        self.pad_vocab = True  # Megatron pads the vocabulary; plain DeepSpeed models do not
        gen = torch.Generator().manual_seed(seed)
        self.full = {}
        # The torch optimizer's per-element states: Adam's two moments, or SGD's momentum.
        self.optimizer = optimizer
        self.states = ("exp_avg", "exp_avg_sq") if optimizer == "adam" else ("momentum_buffer",)
        for name, (shape, _) in self.params.items():
            if optimizer == "sgd":
                self.full[name] = {
                    "fp32": torch.randn(shape, generator=gen),
                    "momentum_buffer": torch.randn(shape, generator=gen) * 1e-3,
                }
                continue
            self.full[name] = {
                "fp32": torch.randn(shape, generator=gen),
                "exp_avg": torch.randn(shape, generator=gen) * 1e-3,
                "exp_avg_sq": torch.rand(shape, generator=gen) * 1e-6,
            }

    def layer_suffixes(self):
        """The per-layer parameter suffixes in module order (experts included)."""
        out = [s for s, _, _ in {"gpt": GPT_LAYER, "llama": LLAMA_LAYER,
                                 "mixtral": MIXTRAL_LAYER}[self.family]]
        for e in range(self.experts):
            out += [f"mlp.experts.{e}.{s}" for s, _, _ in MIXTRAL_EXPERT]
        return out

    def padded_vocab(self, tp):
        m = self.divisible_by * tp
        return (self.vocab + m - 1) // m * m

    def tp_slice(self, name, state, tp, r, gen, qkv="per-group"):
        shape, kind = self.params[name]
        t = self.full[name][state]
        if qkv == "per-rank-blocks" and "query_key_value" in name:
            return self.rank_blocks(t.chunk(tp, 0)[r], tp)
        if kind == "rep" or tp == 1 and kind != "vocab":
            return t.clone()
        if kind == "vocab":
            pad = self.padded_vocab(tp) - self.vocab if self.pad_vocab else 0
            junk = torch.randn((pad, shape[1]), generator=gen)  # padding rows: stripped by readers
            return torch.cat([t, junk]).chunk(tp, 0)[r].clone()
        if kind == "swiglu":  # Megatron's per-rank [gate_r; up_r]
            gate, up = t.chunk(2, 0)
            return torch.cat([gate.chunk(tp, 0)[r], up.chunk(tp, 0)[r]]).clone()
        dim = 1 if kind == "row" else 0
        return t.chunk(tp, dim)[r].clone()


def rank_blocks_of(model, shard, tp):
    """A TP shard of the fused QKV (whole query groups, each [q heads of the group | k | v] rows)
    in the order Megatron-DeepSpeed uses since PR #441 (676a482c, megatron/model/transformer.py):
    the rank's q rows, then its k rows, then its v rows ([Q_r | K_r | V_r])."""
    d = model.h // model.heads
    groups = model.kv_heads // tp
    q = model.heads // model.kv_heads * d
    g = shard.reshape(groups, q + 2 * d, *shard.shape[1:])
    return torch.cat([g[:, :q].reshape(-1, *shard.shape[1:]),
                      g[:, q:q + d].reshape(-1, *shard.shape[1:]),
                      g[:, q + d:].reshape(-1, *shard.shape[1:])]).clone()


Model.rank_blocks = lambda self, shard, tp: rank_blocks_of(self, shard, tp)


def engine_name(model, canon, flavour):
    if flavour == "plain":
        return canon
    L = model.layers
    if flavour == "pipe":
        if canon.startswith("embedding."):
            prefix = "tied_modules.embed." if model.tied else "1."
            return prefix + canon[len("embedding."):]
        if canon.startswith("layers."):
            _, i, rest = canon.split(".", 2)
            return f"{int(i) + 2}.{rest}"
        if canon == "output_layer.weight":
            return f"{L + 3}.lm_head.weight"
        return f"{L + 2}.{canon.split('.')[-1]}"
    if canon.startswith("embedding.") or canon.startswith("output_layer."):
        return "language_model." + canon
    return "language_model.encoder." + canon


def stage_layers(model, pp, stage):
    """The transformer layers of pipeline stage `stage`: model.stages (layers per stage, as
    PipelineModule's partition_method cut them) when set, else the even split."""
    counts = getattr(model, "stages", None) or [model.layers // pp] * pp
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def stage_params(model, pp, stage):
    """Canonical names held by pipeline stage `stage`, in module order (tied embeddings first)."""
    embed = [n for n in model.params if n.startswith("embedding.")]
    names = []
    if stage == 0 or stage == pp - 1 and model.tied:
        names += embed
    for i in stage_layers(model, pp, stage):
        names += [f"layers.{i}.{s}" for s in model.layer_suffixes()]
    if stage == pp - 1:
        names += [n for n in model.params if n.startswith("final_layernorm.")]
        if not model.tied:
            names += ["output_layer.weight"]
    return names


def rng_state():
    # Seeded so the files are reproducible (torch's default generator is seeded per process).
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None,
             "rng_tracker_states": {}}]


def megatron_args(model, tp, pp, sp, lp, optimizer, dp, iteration):
    # The flags Megatron-DeepSpeed's UniversalCheckpointInfo reads (normalization,
    # add_position_embedding, add_bias_linear, swiglu, untie_embeddings_and_output_weights) are
    # set for every family, as Megatron's argparse always sets them: GPT has Megatron's defaults.
    # Real args also always hold model_type (megatron.core.enums.ModelType); only the llama
    # fixtures carry it, since libucp's ds_universal_check.py torch.loads copies of the GPT
    # fixtures' model states where no Megatron module is importable.
    kw = dict(
        num_layers=model.layers, hidden_size=model.h, num_attention_heads=model.heads,
        ffn_hidden_size=model.ffn, max_position_embeddings=model.positions, seq_length=16,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        ds_sequence_parallel_size=sp, make_vocab_size_divisible_by=model.divisible_by,
        padded_vocab_size=model.padded_vocab(tp), bf16=lp == "bf16", fp16=lp == "fp16",
        lr=3e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        iteration=iteration, deepspeed=True, zero_stage=1 if optimizer != "zero2" else 2,
        normalization="layernorm", add_position_embedding=True, add_bias_linear=True,
        swiglu=False, untie_embeddings_and_output_weights=False)
    if model.family == "llama":  # Megatron-DeepSpeed's LLaMA recipe (examples_deepspeed)
        kw.update(num_key_value_heads=model.kv_heads, kv_channels=model.h // model.heads,
                  swiglu=True, normalization="rmsnorm", add_position_embedding=False,
                  use_rotary_position_embeddings=True, untie_embeddings_and_output_weights=True,
                  add_bias_linear=False, model_type=ModelType.encoder_or_decoder)
    return argparse.Namespace(**kw)


def universal_info(model, args, pipe):
    """universal_checkpoint_info exactly as Megatron-DeepSpeed writes it (HEAD 4efb479d:
    checkpointing._universal_checkpoint_info + gpt_model.UniversalCheckpointInfo, translated line
    by line, same keys, order and regex strings), from the run's args and model class (pipe:
    GPTModelPipe, else GPTModel). Its lists are faithful, not right: a TP=1 run saves no
    TP-replicated or row-parallel list (since Megatron-DeepSpeed 71e8407c), so DeepSpeed merges
    such a checkpoint with cat_dim 0 for the row-parallel weights, and the fused QKV is never
    declared as sub-parameters. ucp ignores these lists and uses its own rules (docs/deepspeed.md);
    the fixtures carry them so that DeepSpeed's ds_to_universal reads the fixtures as it would
    read a real run's files (tests/peer)."""
    pre = "" if pipe else "language_model.encoder.layers."
    if pipe:
        vocab = ([r"\d+.word_embeddings.weight", r"\d+.lm_head.weight"]
                 if args.untie_embeddings_and_output_weights
                 else [r"tied_modules.embed.word_embeddings.weight"])
    else:
        vocab = ["language_model.embedding.word_embeddings.weight"]
        if args.untie_embeddings_and_output_weights:
            vocab.append("language_model.output_layer.weight")
    uci = {"universal_checkpoint_version": UNIVERSAL_CHECKPOINT_VERSION,
           "original_vocab_size": model.vocab, "padded_vocab_size": args.padded_vocab_size,
           "vocabulary_parameter_patterns": vocab}
    if pipe:  # the tied module's copies on the first and last stage: only stage 0's is kept
        replicated = []
        if not args.untie_embeddings_and_output_weights:
            replicated = list(vocab)
            if args.add_position_embedding:
                replicated.append(r"tied_modules.embed.position_embeddings.weight")
        uci["pipeline_replicated_parameter_patterns"] = replicated
    if args.tensor_model_parallel_size > 1:
        rep = [pre + r"\d+.input_layernorm.weight", pre + r"\d+.post_attention_layernorm.weight",
               r"\d+.weight" if pipe else "language_model.encoder.final_layernorm.weight"]
        if args.normalization == "layernorm":
            rep.append(r"\d+.bias" if pipe else "language_model.encoder.final_layernorm.bias")
        if args.add_position_embedding:
            rep.append("tied_modules.embed.position_embeddings.weight" if pipe
                       else "language_model.embedding.position_embeddings.weight")
        if args.add_bias_linear:
            rep += [pre + r"\d+.self_attention.dense.bias", pre + r"\d+.mlp.dense_4h_to_h.bias"]
        if args.normalization == "layernorm":
            rep += [pre + r"\d+.input_layernorm.bias", pre + r"\d+.post_attention_layernorm.bias"]
        uci["tp_replicated_parameter_patterns"] = rep
        uci["parameter_with_row_parallelism_patterns"] = [
            pre + r"\d+.mlp.dense_4h_to_h.weight", pre + r"\d+.self_attention.dense.weight"]
    swiglu = []  # written at any TP, empty without --swiglu
    if args.swiglu:
        swiglu.append(pre + r"\d+.mlp.dense_h_to_4h.weight")
        if args.add_bias_linear:
            swiglu.append(pre + r"\d+.mlp.dense_h_to_4h.bias")
    uci["parameter_with_2_sub_params_cat_dim_0"] = swiglu
    return uci


def write_layout(out, model, tp, pp, dp, sp, lp, optimizer, flavour, meta_dims, seed,
                 groups="megatron", sub_group_size=None, qkv="per-group", post441=False):
    """optimizer: 'bf16' (BF16_Optimizer), 'zero1' or 'zero2' (DeepSpeedZeroOptimizer), 'zero3'
    (DeepSpeedZeroOptimizer_Stage3, sub-groups of sub_group_size elements per rank);
    groups: 'megatron' (weight decay on >= 2-d non-biases, then the rest) or 'one';
    qkv: the fused QKV's row order in every state ('per-group', or 'per-rank-blocks' as
    Megatron-DeepSpeed since PR #441 trains it); post441: the args hold the flags PR #441 added
    (ds_sequence_parallel_fpdt*), as every run of that code saves them."""
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
                 "zero_optimization": {"stage": {"zero2": 2, "zero3": 3}.get(optimizer, 1)}}
    if optimizer == "zero3" and sub_group_size:
        ds_config["zero_optimization"]["sub_group_size"] = sub_group_size
    args = megatron_args(model, tp, pp, sp, lp, optimizer, dp, iteration)
    if post441:  # megatron/arguments.py since 676a482c
        args.ds_sequence_parallel_fpdt = False
        args.ds_sequence_parallel_fpdt_chunk_size = 65536
        args.ds_sequence_parallel_fpdt_offloading = False
    prefix = "bf16_" if lp == "bf16" else ""
    for s in range(pp):
        names = stage_params(model, pp, s)
        for r in range(tp):
            mp = s * tp + r if flavour == "pipe" else r
            slices = {n: {st: model.tp_slice(n, st, tp, r, gen, qkv)
                          for st in ("fp32",) + model.states}
                      for n in names}
            if groups == "one":
                opt_groups = [names]
            else:
                opt_groups = [
                    [n for n in names if not n.endswith(".bias") and len(model.params[n][0]) >= 2],
                    [n for n in names if n.endswith(".bias") or len(model.params[n][0]) < 2]]
            param_shapes = [collections.OrderedDict(
                (engine_name(model, n, flavour), torch.Size(slices[n]["fp32"].shape)) for n in g)
                for g in opt_groups]
            # Flat groups: concatenated and NaN-padded to a multiple of 2 * nd.
            flat = []
            for g in opt_groups:
                parts = {st: torch.cat([slices[n][st].reshape(-1) for n in g])
                         for st in ("fp32",) + model.states}
                n = parts["fp32"].numel()
                aligned = (n + 2 * nd - 1) // (2 * nd) * (2 * nd)
                for st in parts:
                    parts[st] = torch.cat([parts[st], torch.full((aligned - n,), float("nan"))])
                offsets, o = [], 0
                for name in g:
                    offsets.append((name, o, slices[name]["fp32"].numel()))
                    o += slices[name]["fp32"].numel()
                flat.append((parts, n, aligned, offsets))
            if optimizer == "zero3":
                assert model.optimizer == "adam", "the ZeRO-3 fixtures are written for Adam"
                write_zero3(folder, prefix, model, names, opt_groups, slices, flavour, nd, r,
                            lp_dtype, ds_config, args, iteration, tp, meta_dims, sub_group_size)
                continue
            model_states = collections.OrderedDict()
            if flavour == "pipe":
                model_states["module"] = None
            elif flavour == "gpt-nested":
                model_states["module"] = nested_module(
                    names, {n: slices[n]["fp32"].to(lp_dtype) for n in names})
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
            model_states.update(ds_config=ds_config, ds_version=DS_VERSION)
            if flavour != "plain":
                model_states.update(args=args, checkpoint_version=3.0, iteration=iteration,
                                    tokens=iteration * 128,
                                    universal_checkpoint_info=universal_info(model, args,
                                                                           flavour == "pipe"),
                                    rng_state=rng_state())
            torch.save(model_states, os.path.join(folder, f"mp_rank_{mp:02d}_model_states.pt"))
            if flavour == "pipe":
                write_layer_files(folder, model, pp, s, r, slices, lp_dtype)
            for d in range(nd):
                write_optim(folder, prefix, d, mp, flat, optimizer, nd, ds_config, flavour, model,
                            iteration)


def write_zero3(folder, prefix, model, names, opt_groups, slices, flavour, nd, r, lp_dtype,
                ds_config, args, iteration, tp, meta_dims, sub_group_size):
    """ZeRO-3 (stage3.py): per data-parallel rank d a zero_pp_rank_d_mp_rank_RR_model_states.pt
    (param_shapes per sub-group, `module` of empty placeholders) and an optim file whose
    fp32_flat_groups[i] is piece d (ceil(numel / nd) elements, the last NaN-padded) of each
    parameter of sub-group i, back to back. Sub-groups split each param group as
    _create_fp16_sub_groups does: close one once its partition elements reach sub_group_size."""
    subs = []  # (param group index, names)
    for g, group in enumerate(opt_groups):
        cur, size = [], 0
        for n in group:
            cur.append(n)
            size += (slices[n]["fp32"].numel() + nd - 1) // nd
            if (sub_group_size and size >= sub_group_size) or n == group[-1]:
                subs.append((g, cur))
                cur, size = [], 0
    pieces = {}  # name -> state -> padded flat of nd pieces
    for n in names:
        num = slices[n]["fp32"].numel()
        piece = (num + nd - 1) // nd
        pieces[n] = {st: torch.cat([slices[n][st].reshape(-1),
                                    torch.full((piece * nd - num,), float("nan"))])
                     for st in ("fp32", "exp_avg", "exp_avg_sq")}
    param_shapes = [collections.OrderedDict(
        (engine_name(model, n, flavour), torch.Size(slices[n]["fp32"].shape)) for n in sub)
        for _, sub in subs]
    for d in range(nd):
        model_states = collections.OrderedDict(
            module=collections.OrderedDict(
                (engine_name(model, n, flavour), torch.empty(0, dtype=lp_dtype)) for n in names),
            buffer_names=[], optimizer=None, param_shapes=param_shapes,
            frozen_param_shapes=collections.OrderedDict(), shared_params={},
            frozen_param_fragments=collections.OrderedDict(),
            lr_scheduler={"num_steps": iteration}, data_sampler=None, random_ltd=None,
            sparse_tensor_module_names=set(), skipped_steps=0, global_steps=iteration,
            global_samples=iteration * 8 * nd, dp_world_size=nd, mp_world_size=tp)
        if meta_dims:
            model_states["checkpoint_parallel_dimensions"] = {"pp_degree": 1, "tp_degree": tp}
        model_states.update(ds_config=ds_config, ds_version=DS_VERSION)
        if flavour != "plain":
            model_states.update(args=args, checkpoint_version=3.0, iteration=iteration,
                                tokens=iteration * 128,
                                universal_checkpoint_info=universal_info(model, args, False),
                                rng_state=rng_state())
        torch.save(model_states,
                   os.path.join(folder, f"zero_pp_rank_{d}_mp_rank_{r:02d}_model_states.pt"))
        flat, state, groups = [], {}, [None] * len(opt_groups)
        for i, (g, sub) in enumerate(subs):
            parts = {}
            for st in ("fp32", "exp_avg", "exp_avg_sq"):
                parts[st] = torch.cat([
                    pieces[n][st][d * ((slices[n]["fp32"].numel() + nd - 1) // nd):
                                  (d + 1) * ((slices[n]["fp32"].numel() + nd - 1) // nd)]
                    for n in sub])
            flat.append(parts["fp32"])
            state[i] = {"step": torch.tensor(float(iteration)), "exp_avg": parts["exp_avg"],
                        "exp_avg_sq": parts["exp_avg_sq"]}
            if groups[g] is None:
                groups[g] = {"weight_decay": 0.1 if g == 0 else 0.0, "lr": 3e-4,
                             "betas": (0.9, 0.95), "eps": 1e-8, "amsgrad": False, "params": []}
            groups[g]["params"].append(i)
        osd = collections.OrderedDict(
            zero_stage=ZeroStageEnum(3), loss_scaler=LossScaler(1.0), dynamic_loss_scale=False,
            overflow=False, partition_count=nd,
            optimizer_state_dict={"state": state, "param_groups": groups},
            fp32_flat_groups=flat)
        torch.save({"optimizer_state_dict": osd, "ds_config": ds_config, "ds_version": DS_VERSION},
                   os.path.join(folder, f"{prefix}zero_pp_rank_{d}_mp_rank_{r:02d}_optim_states.pt"))


def nested_module(names, weights):
    """GPTModel's `module` as Megatron-DeepSpeed saves it (its save swaps the module's state_dict
    for state_dict_for_save_checkpoint): language_model -> embedding -> word_embeddings ->
    weight (and position_embeddings), encoder -> flat "layers.N.<rest>" and final_layernorm keys,
    output_layer -> weight when untied."""
    emb, enc, out = (collections.OrderedDict() for _ in range(3))
    for n in names:
        if n.startswith("embedding."):
            _, sub, leaf = n.split(".", 2)
            emb.setdefault(sub, collections.OrderedDict())[leaf] = weights[n]
        elif n.startswith("output_layer."):
            out[n[len("output_layer."):]] = weights[n]
        else:
            enc[n] = weights[n]
    lm = collections.OrderedDict(embedding=emb, encoder=enc)
    if out:
        lm["output_layer"] = out
    return collections.OrderedDict(language_model=lm)


def write_layer_files(folder, model, pp, s, r, slices, lp_dtype):
    """GPTModelPipe's layer files: spec index 1 the embedding (the tied module's only file), 2..L+1
    the layers, L+2 the final norm, L+3 the untied head (the tied head is a function: no file)."""
    L = model.layers
    layers = {}
    if s == 0:
        layers[1] = {k[len("embedding."):]: slices[k]["fp32"] for k in model.params
                     if k.startswith("embedding.")}
    for i in stage_layers(model, pp, s):
        layers[i + 2] = {suf: slices[f"layers.{i}.{suf}"]["fp32"] for suf in model.layer_suffixes()}
    if s == pp - 1:
        layers[L + 2] = {k.split(".")[-1]: slices[k]["fp32"] for k in model.params
                         if k.startswith("final_layernorm.")}
        if not model.tied:
            layers[L + 3] = {"lm_head.weight": slices["output_layer.weight"]["fp32"]}
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
        if model.optimizer == "sgd":  # torch.optim.SGD with momentum keeps no step
            states[g] = {"momentum_buffer": parts["momentum_buffer"][lo:hi].clone()}
        else:
            states[g] = {"step": torch.tensor(float(iteration)),
                         "exp_avg": parts["exp_avg"][lo:hi].clone(),
                         "exp_avg_sq": parts["exp_avg_sq"][lo:hi].clone()}
        m = collections.OrderedDict()
        for name, o, num in offsets:
            a, b = max(o, lo), min(o + num, hi)
            if a < b:
                m[engine_name(model, name, flavour)] = fragment_address(numel=b - a, start=a - lo)
        mappings.append(m)
        if model.optimizer == "sgd":  # torch 1.13 SGD's group keys, in its order
            param_groups.append({"lr": 3e-4, "momentum": 0.9, "dampening": 0,
                                 "weight_decay": 0.1 if g == 0 else 0.0, "nesterov": False,
                                 "maximize": False, "foreach": None, "differentiable": False,
                                 "params": [g]})
        else:
            param_groups.append({"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8,
                                 "weight_decay": 0.1 if g == 0 else 0.0, "amsgrad": False,
                                 "params": [g]})
    base = {"state": states, "param_groups": param_groups}
    if optimizer == "bf16":
        osd = collections.OrderedDict(
            clip_grad=1.0, base_optimizer_state=base, single_partition_of_fp32_groups=fp32_groups,
            group_paddings=paddings, partition_count=[nd] * len(flat), ds_version=DS_VERSION,
            param_slice_mappings=mappings)
    else:
        osd = collections.OrderedDict(
            loss_scaler=LossScaler(65536.0), dynamic_loss_scale=True, overflow=False,
            clip_grad=1.0, base_optimizer_state=base,
            single_partition_of_fp32_groups=fp32_groups,
            zero_stage=ZeroStageEnum(2 if optimizer == "zero2" else 1), group_paddings=paddings,
            partition_count=[nd] * len(flat), ds_version=DS_VERSION, param_slice_mappings=mappings)
    torch.save({"optimizer_state_dict": osd, "ds_config": ds_config, "ds_version": DS_VERSION},
               os.path.join(folder, f"{prefix}zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt"))


def save_expected(path, model):
    """The truth: per canonical parameter its fp32 master weight, optimizer states (Adam's
    moments, SGD's momentum) and the weights in each training dtype, as torch rounds them
    (model_bf16, model_fp16)."""
    torch.save(collections.OrderedDict(
        (n, collections.OrderedDict(
            [(s, model.full[n][s]) for s in ("fp32",) + model.states] +
            [("model_bf16", model.full[n]["fp32"].to(torch.bfloat16)),
             ("model_fp16", model.full[n]["fp32"].to(torch.float16))]))
        for n in model.params), path)


def save_model_file(path, name, model, divisible_by):
    """A ucp model file (schemas/model.schema.json) for a plain DeepSpeed layout, whose files
    carry no Megatron args: `ucp ... --model <this file>`."""
    hyper = {"hidden": model.h, "layers": model.layers, "heads": model.heads,
             "kv_heads": model.kv_heads, "ffn_hidden": model.ffn, "vocab": model.vocab,
             "max_positions": model.positions, "make_vocab_size_divisible_by": divisible_by,
             "tied_embeddings": model.tied}
    if model.experts:
        hyper["num_experts"] = model.experts
    with open(path, "w") as f:
        json.dump({"$schema": "../../../../schemas/model.schema.json", "name": name,
                   "family": model.family, "dtype": "bf16",
                   "source": "tools/make_deepspeed_fixtures.py: the model of the plain DeepSpeed "
                             "fixtures (unpadded vocabulary)",
                   "hyper": hyper}, f, indent=1)
        f.write("\n")


# name: (tp, pp, dp, sp, low precision, optimizer, naming flavour, checkpoint_parallel_dimensions)
LAYOUTS = {
    "megatron_tp2_pp1_dp2_bf16": (2, 1, 2, 1, "bf16", "bf16", "gpt", True),
    "megatron_tp1_pp2_dp2_bf16": (1, 2, 2, 1, "bf16", "bf16", "pipe", False),
    "megatron_tp2_pp2_sp2_fp16_zero1": (2, 2, 1, 2, "fp16", "zero1", "pipe", True),
    "deepspeed_tp1_pp1_dp4_fp16_zero2": (1, 1, 4, 1, "fp16", "zero2", "plain", False),
}
LLAMA_LAYOUTS = {
    "megatron_llama_tp2_pp2_dp2_bf16": (2, 2, 2, 1, "bf16", "bf16", "pipe", False),
    "megatron_llama_tp2_pp1_dp2_fp16_zero1": (2, 1, 2, 1, "fp16", "zero1", "gpt", True),
    # GPTModel with `module` nested as Megatron-DeepSpeed's save writes it (nested_module).
    "megatron_llama_nested_tp2_pp1_dp2_fp16_zero1": (2, 1, 2, 1, "fp16", "zero1", "gpt-nested",
                                                     True),
}
# ZeRO-3 (Megatron-DeepSpeed GPTModel with TP), sub_group_size 100: several sub-groups per group.
LLAMA_ZERO3_LAYOUTS = {
    "megatron_llama_zero3_tp2_dp3_bf16": (2, 1, 3, 1, "bf16", "zero3", "gpt", False),
}
# The fused QKV in Megatron-DeepSpeed's row order since PR #441 ([Q_r | K_r | V_r] per tp rank):
# name: (layout as LAYOUTS, args with the #441 flags). The first is detected from its args;
# the second (args without them, as a fork's) needs --qkv-layout per-rank-blocks.
QKV_LAYOUTS = {
    "megatron_qkv441_tp2_pp1_dp2_bf16": ((2, 1, 2, 1, "bf16", "bf16", "gpt", True), True),
    "megatron_qkvblocks_tp1_pp1_dp2_fp16_zero1": ((1, 1, 2, 1, "fp16", "zero1", "gpt", True),
                                                  False),
}
# torch.optim.SGD with momentum (a client optimizer, so ds_config names none): its per-group
# state is momentum_buffer alone, no step; its param groups SGD's keys.
SGD_LAYOUTS = {
    "megatron_sgd_tp2_pp1_dp2_fp16_zero2": (2, 1, 2, 1, "fp16", "zero2", "gpt", True),
}
# Uneven pipeline stages: a 3-layer GPTModelPipe at pp=2 holds 2 + 1 transformer layers, the
# split partition_method 'type:transformer' (Megatron-DeepSpeed's) and 'uniform' both give for
# its spec list [fn, embedding, 3 layers, norm, tied head] (partition_balanced / _uniform cut
# it at index 4).
UNEVEN_LAYOUTS = {
    "megatron_uneven_tp2_pp2_dp2_bf16": (2, 2, 2, 1, "bf16", "bf16", "pipe", False),
}
MIXTRAL_LAYOUTS = {
    "deepspeed_mixtral_tp1_pp1_dp2_bf16_zero1": (1, 1, 2, 1, "bf16", "zero1", "plain", False),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--big", action="store_true",
                   help="GPT-2-small-sized tp=2,pp=2,dp=2 bf16 checkpoint for the benchmark")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.big:
        model = Model("gpt", 768, 12, 6, 50257, 1024, 128, seed=11)
        write_layout(os.path.join(a.out, "gpt2_tp2_pp2_dp2_bf16"), model, 2, 2, 2, 1, "bf16",
                     "bf16", "pipe", True, seed=12)
        save_expected(os.path.join(a.out, "expected.pt"), model)
        return
    model = Model("gpt", 16, 4, 2, 50, 16, 8, seed=7)
    save_expected(os.path.join(a.out, "expected.pt"), model)
    for i, (name, spec) in enumerate(LAYOUTS.items()):
        write_layout(os.path.join(a.out, name), model, *spec, seed=100 + i)
    for i, (name, (spec, post441)) in enumerate(QKV_LAYOUTS.items()):
        write_layout(os.path.join(a.out, name), model, *spec, seed=150 + i,
                     qkv="per-rank-blocks", post441=post441)
    os.makedirs(os.path.join(a.out, "models"), exist_ok=True)
    save_model_file(os.path.join(a.out, "models", "gpt-plain.json"), "gpt-plain", model, 1)

    llama = Model("llama", 16, 4, 2, 50, 16, 8, seed=8, kv_heads=2, ffn=24)
    save_expected(os.path.join(a.out, "expected_llama.pt"), llama)
    for i, (name, spec) in enumerate(LLAMA_LAYOUTS.items()):
        write_layout(os.path.join(a.out, name), llama, *spec, seed=200 + i)
    for i, (name, spec) in enumerate(LLAMA_ZERO3_LAYOUTS.items()):
        write_layout(os.path.join(a.out, name), llama, *spec, seed=250 + i, sub_group_size=100)

    sgd = Model("gpt", 16, 4, 2, 50, 16, 8, seed=10, optimizer="sgd")
    save_expected(os.path.join(a.out, "expected_sgd.pt"), sgd)
    for i, (name, spec) in enumerate(SGD_LAYOUTS.items()):
        write_layout(os.path.join(a.out, name), sgd, *spec, seed=350 + i)

    uneven = Model("gpt", 16, 4, 3, 50, 16, 8, seed=13)
    uneven.stages = [2, 1]
    save_expected(os.path.join(a.out, "expected_uneven.pt"), uneven)
    for i, (name, spec) in enumerate(UNEVEN_LAYOUTS.items()):
        write_layout(os.path.join(a.out, name), uneven, *spec, seed=400 + i)

    mixtral = Model("mixtral", 16, 4, 2, 36, 16, 4, seed=9, kv_heads=2, ffn=8, experts=4)
    save_expected(os.path.join(a.out, "expected_mixtral.pt"), mixtral)
    for i, (name, spec) in enumerate(MIXTRAL_LAYOUTS.items()):
        write_layout(os.path.join(a.out, name), mixtral, *spec, seed=300 + i, groups="one")
    save_model_file(os.path.join(a.out, "models", "mixtral-plain.json"), "mixtral-plain",
                    mixtral, 4)
    write_sums(a.out)


def write_sums(out):
    """SHA256SUMS of every fixture file (`sha256sum -c` format): the files are reproducible, so a
    regeneration that changes them, or an edit by hand, shows up in the CLI test."""
    lines = []
    for root, _, files in os.walk(out):
        for f in files:
            path = os.path.join(root, f)
            rel = os.path.relpath(path, out)
            if rel == "SHA256SUMS":
                continue
            with open(path, "rb") as fh:
                lines.append(f"{hashlib.sha256(fh.read()).hexdigest()}  {rel}\n")
    with open(os.path.join(out, "SHA256SUMS"), "w") as fh:
        fh.writelines(sorted(lines, key=lambda l: l.split("  ", 1)[1]))


if __name__ == "__main__":
    main()
