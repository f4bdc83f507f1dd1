"""Peer tests against the real DeepSpeed: ucp reads what DeepSpeed writes, DeepSpeed reads what
ucp writes. Run with the peer venv's python (tools/setup_peers.sh); tests/peer/peer_test.sh strings
the subcommands together with the ucp CLI, and docs/peers.md says what each test proves.

    train        --work W --zero Z [--sub-group-size N]
                                       a dp=2 CPU engine run: checkpoint at step SAVE_STEP
                                       (W/ckpt), losses of steps 1..LAST_STEP (W/losses.json), the
                                       engine's exact fp32/Adam state when it saved (W/truth.pt);
                                       ZeRO-3 with N: sub-groups of about N elements per rank
    ds-universal --work W --out O      DeepSpeed's ds_to_universal on W/ckpt, into O
    extract      --work W --ucp U --out O
                                       ucp's extraction U == ds_to_universal (into O) ==
                                       zero_to_fp32 == the engine's state, bitwise (ZeRO-3:
                                       DeepSpeed 0.14.4's ds_to_universal has no ZeRO-3 path, so
                                       U == zero_to_fp32 == the engine's state; dtu-vs-ucp runs a
                                       current one)
    fixtures     --data D              DeepSpeed's ds_to_universal on each of ucp's committed
                                       fixtures (FIXTURES) gives its model's D/expected*.pt
    resume       --work W --load L --dp P --mode universal|zero [--ucp U] [--zero Z]
                                       a fresh engine at dp=P loads L: its state is the saved one,
                                       bitwise, and its losses continue the run of `train`
    universal-loader --dsu D --tag T --ucp U --out O [--ds-to-universal]
                                       DeepSpeed's load_hp_checkpoint_state on D (ucp's
                                       --format deepspeed-universal of U) gives each tp rank's
                                       slices of T (ucp's --format deepspeed of U at dp=1),
                                       bitwise; optionally ds_to_universal on T writes D's files
    same-as-dtu  --dsu D --tag T --ucp U --out O
                                       D (ucp's --format deepspeed-universal of U, ucp's
                                       extraction of the DeepSpeed tag T) holds the files
                                       ds_to_universal writes from T (keys, 'param' bitwise)
    reads-ucp    --tag T --ucp U --out O
                                       DeepSpeed's ds_to_universal on T (a checkpoint ucp wrote
                                       with --format deepspeed) gives U's fp32 / exp_avg /
                                       exp_avg_sq bitwise and U's step
    dtu-vs-ucp   --tag T --ucp U --out O [--truth F]
                                       run with the newer DeepSpeed's venv
                                       (tools/peer-dsu-requirements.txt): its ds_to_universal on
                                       the ZeRO-3 tag T == U (ucp extract of T) bitwise, fp32 /
                                       exp_avg / exp_avg_sq and step, and == F if given

Everything is fp32: under gloo, torch 1.13 cannot broadcast bf16 (docs/peers.md).
"""

import argparse
import contextlib
import datetime
import importlib.metadata
import io
import json
import math
import os
import re
import shutil
import socket
import sys
import tempfile

import torch
import torch.nn.functional as F

# The run: a tiny GPT whose parameter names are ucp's canonical gpt.json names (gpt-peer.json is
# its preset), trained on a fixed token stream so that every data-parallel size sees the same
# global batch at every step.
HIDDEN, HEADS, LAYERS, VOCAB, POSITIONS = 32, 4, 2, 64, 16
GLOBAL_BATCH, SEQ = 8, 16
SAVE_STEP, LAST_STEP = 4, 8
# The run's optimizer (env UCP_PEER_OPTIMIZER, so that spawned ranks see it too): DeepSpeed's
# AdamW from the config, or a client torch.optim.SGD with momentum, whose one per-element state is
# momentum_buffer and which keeps no step (ucp carries the state under its own name).
OPTIMIZER = os.environ.get("UCP_PEER_OPTIMIZER", "adamw")
assert OPTIMIZER in ("adamw", "sgd"), f"UCP_PEER_OPTIMIZER={OPTIMIZER}: adamw or sgd"
STATES = ("fp32", "exp_avg", "exp_avg_sq") if OPTIMIZER == "adamw" else ("fp32", "momentum_buffer")
# Resuming at another dp size changes only the order of the gradient reductions (one process sums
# 8 sequences, two sum 4 each and average). Measured with DeepSpeed's own universal checkpoint
# resumed at dp=1: the losses of steps 5..8 move by at most 6.6e-8 relative. Wrong state moves them
# far more: an Adam step off by one 6.2e-3, zeroed exp_avg 3.4e-2. (A single ulp in one weight
# moves them by 6.6e-8 too, which is why the loaded state is also compared bitwise.)
LOSS_RTOL_OTHER_DP = 1e-5


# ---------------------------------------------------------------------------------------------
# DeepSpeed on CPU


def import_deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    import logging
    import deepspeed
    import deepspeed.comm.torch
    deepspeed.utils.logger.setLevel(logging.WARNING)  # the engine logs its whole config at INFO
    # DeepSpeed's CPU TorchBackend JIT-compiles its shared-memory all-reduce op (deepspeed_shm_comm)
    # at init; that needs torch/extension.h, which Debian's python3-torch does not ship (it is in
    # libtorch-dev), so init fails. The op only speeds up all-reduce within a node; without it
    # DeepSpeed uses torch.distributed (gloo) for the same reduction.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    return deepspeed


class Embedding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = torch.nn.Embedding(POSITIONS, HIDDEN)


class SelfAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.query_key_value = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.dense = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):  # x: [batch, seq, hidden]
        b, s, _ = x.shape
        d = HIDDEN // HEADS
        # Megatron's fused QKV rows are per head [q | k | v] (gpt.json's interleaved_groups).
        qkv = self.query_key_value(x).view(b, s, HEADS, 3 * d)
        q, k, v = (t.transpose(1, 2) for t in qkv.split(d, dim=-1))  # [batch, heads, seq, d]
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.dense((att @ v).transpose(1, 2).reshape(b, s, HIDDEN))


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dense_h_to_4h = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
        self.dense_4h_to_h = torch.nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = torch.nn.LayerNorm(HIDDEN)
        self.self_attention = SelfAttention()
        self.post_attention_layernorm = torch.nn.LayerNorm(HIDDEN)
        self.mlp = Mlp()

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Gpt(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = Embedding()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(LAYERS))
        self.final_layernorm = torch.nn.LayerNorm(HIDDEN)

    def forward(self, tokens):  # tokens: [batch, seq + 1]
        x, y = tokens[:, :-1], tokens[:, 1:]
        pos = torch.arange(x.shape[1])
        h = self.embedding.word_embeddings(x) + self.embedding.position_embeddings(pos)
        for layer in self.layers:
            h = layer(h)
        # Tied output layer: the word embedding, as Megatron's default.
        logits = F.linear(self.final_layernorm(h), self.embedding.word_embeddings.weight)
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def make_model():
    torch.manual_seed(1234)
    model = Gpt()
    for name, p in model.named_parameters():  # Megatron's init: N(0, 0.02) weights, zero biases
        if name.endswith(".bias"):
            torch.nn.init.zeros_(p)
        elif not name.endswith("layernorm.weight"):
            torch.nn.init.normal_(p, std=0.02)
    return model


def param_groups(model):
    """Megatron's two groups in named_parameters order: >=2-dim non-bias weights with weight decay,
    then the rest without."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.dim() >= 2 and not n.endswith(".bias")]
    rest = [p for n, p in named if not (p.dim() >= 2 and not n.endswith(".bias"))]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def global_batch(step):
    """The global batch of optimizer step `step` (1-based), the same whatever the dp size."""
    gen = torch.Generator().manual_seed(10_000 + step)
    # A learnable stream: each sequence counts up by a random stride from a random start.
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=gen)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=gen)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def ds_config(dp, zero, universal, sub_group_size=None):
    zero_cfg = {"stage": zero}
    if sub_group_size:
        zero_cfg["sub_group_size"] = sub_group_size
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 6}},
        "gradient_clipping": 1.0,
        "zero_optimization": zero_cfg,
        "checkpoint": {"load_universal": universal},
        "steps_per_print": 10_000,
    }
    if OPTIMIZER == "sgd":  # a client optimizer (make_engine); ZeRO asks to be told it is one
        del config["optimizer"]
        config["zero_allow_untested_optimizer"] = True
    return config


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn, dp, *args):
    """Runs fn(rank, dp, *args) in dp processes joined by gloo over loopback (dp=1: in-process)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if dp == 1:
        _rank_main(0, fn, dp, args)
    else:
        torch.multiprocessing.spawn(_rank_main, args=(fn, dp, args), nprocs=dp, join=True)


def _rank_main(rank, fn, dp, args):
    # LOCAL_SIZE: the CPU accelerator's device count (one node of dp ranks). Without it DeepSpeed
    # counts NUMA nodes with `numactl --hardware`, which ZeRO-3's gradient reduce-scatter asks for
    # and which this machine need not have.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(dp), LOCAL_SIZE=str(dp))
    torch.set_num_threads(1)  # 2 ranks on 2 cores; also keeps every run's kernels the same
    deepspeed = import_deepspeed()
    # A short timeout: a rank that dies must not leave the other waiting gloo's default 30 min.
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False,
                               timeout=datetime.timedelta(seconds=120))
    # DeepSpeed gathers the updated ZeRO partitions with torch's all_gather_into_tensor because
    # torch 1.13 has the function, but its gloo process group does not implement it ("no support
    # for _allgather_base in Gloo process group"). Without it DeepSpeed uses its own fallback, a
    # list all_gather: the same bytes (gathering copies, it does not add).
    from deepspeed.comm import comm as ds_comm
    ds_comm.cdb.all_gather_function = None
    # ZeRO-3 reduce-scatters gradients; gloo implements neither reduce_scatter_tensor nor the
    # list reduce_scatter DeepSpeed falls back to. The same sum is an all_reduce of the inputs
    # (gloo's own order, the same at every rank) of which each rank keeps its chunk.
    ds_comm.cdb.reduce_scatter_function = None

    def reduce_scatter(output, input_list, op=None, group=None, async_op=False):
        assert not async_op, "the gloo stand-in reduce_scatter is synchronous"
        whole = torch.cat([t.reshape(-1) for t in input_list])
        torch.distributed.all_reduce(whole, group=group)
        me = torch.distributed.get_rank(group=group)
        lo = sum(t.numel() for t in input_list[:me])
        output.copy_(whole[lo:lo + output.numel()].view_as(output))

    ds_comm.cdb.reduce_scatter = reduce_scatter
    fn(rank, dp, *args)
    # Leave together and tear the process group down before the interpreter exits: a rank that
    # exits while gloo's threads still serve its peer can abort in a C++ destructor ("terminate
    # called without an active exception", SIGABRT), which failed about one full peer run in two
    # on 2 shared cores.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def make_engine(dp, zero, universal, sub_group_size=None):
    deepspeed = import_deepspeed()
    config = ds_config(dp, zero, universal, sub_group_size)
    # ZeRO-3 partitions the whole model at initialize (the same seeded weights at every stage).
    model = make_model()
    if OPTIMIZER == "sgd":
        sgd = torch.optim.SGD(param_groups(model), lr=1e-2, momentum=0.9)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=sgd, config=config)
        return engine
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model),
                                           config=config)
    return engine


def train_step(engine, step, rank, dp):
    """One optimizer step on this rank's share of global_batch(step); returns the global loss."""
    from deepspeed import comm as dist
    rows = GLOBAL_BATCH // dp
    loss = engine(global_batch(step)[rank * rows:(rank + 1) * rows])
    engine.backward(loss)
    engine.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return (total / dp).item()


def gather_state_zero3(engine):
    """ZeRO-3: every parameter's fp32 master and Adam moments from the engine's live sub-group
    buffers (DeepSpeedZeroOptimizer_Stage3: fp32_partitioned_groups_flat[i] holds each parameter
    of sub-group fp16_groups[i] as its ds_tensor partition, partition_numel() elements, in order),
    placed at this rank's elements [rank * partition_numel, ...) of the parameter; every element
    must come from exactly one rank. Plus the Adam step."""
    from deepspeed import comm as dist
    opt = engine.optimizer
    rank = dist.get_rank()
    names = {p: n for n, p in engine.module.named_parameters()}
    local = {}
    for i, group in enumerate(opt.fp16_groups):
        flat = opt.fp32_partitioned_groups_flat[i]
        adam = opt.optimizer.state[flat]
        offset = 0
        for p in group:
            part = p.partition_numel()
            lo = min(p.ds_numel, rank * part)
            n = min(part, p.ds_numel - lo)
            frags = {"fp32": flat, "exp_avg": adam["exp_avg"], "exp_avg_sq": adam["exp_avg_sq"]}
            local[names[p]] = (lo, n, {s: t.narrow(0, offset, n).detach().clone()
                                       for s, t in frags.items()})
            offset += part
        assert offset == flat.numel(), f"sub-group {i}: {offset} != {flat.numel()} elements"
    steps = sorted({float(s["step"]) for s in opt.optimizer.state.values()})
    everyone = [None] * dist.get_world_size()
    torch.distributed.all_gather_object(everyone, (local, steps))
    full = {}
    for name, p in engine.module.named_parameters():
        bufs = {s: torch.full((p.ds_numel,), float("nan")) for s in STATES}
        hits = torch.zeros(p.ds_numel, dtype=torch.int32)
        for rank_local, _ in everyone:
            start, numel, frags = rank_local[name]
            for s in STATES:
                bufs[s][start:start + numel] = frags[s]
            hits[start:start + numel] += 1
        assert bool((hits == 1).all()), f"{name}: ZeRO-3 pieces do not cover it exactly once"
        full[name] = {s: bufs[s].reshape(p.ds_shape) for s in STATES}
    all_steps = sorted({s for _, st in everyone for s in st})
    assert len(all_steps) == 1, f"ranks disagree on the Adam step: {all_steps}"
    return full, all_steps[0]


def gather_state(engine):
    """Every parameter's fp32 master weight and Adam moments, assembled exactly from the ranks'
    ZeRO fragments (DeepSpeed's safe_get_full_* sums fragments with zeros, which would turn -0.0
    into +0.0), plus the Adam step. Checks every element comes from exactly one rank."""
    from deepspeed import comm as dist
    if engine.zero_optimization_stage() == 3:
        return gather_state_zero3(engine)
    opt = engine.optimizer
    local = {}
    for name, p in engine.module.named_parameters():
        m = p._hp_mapping
        if m is None:  # no element of p in this rank's partition
            continue
        # Read from the flat fp32 partition and the torch optimizer's state of it, not through
        # the fragment views DeepSpeed 0.14.4 keeps in m: it links the moment views once, right
        # after group 0's first step, when group 1 has no state yet (so group 1's stay empty), and
        # a universal load re-points m.hp_fragment at the last moment's buffer instead of the
        # fp32 partition (map_to_flat_opt_states).
        flat = opt.single_partition_of_fp32_groups[m.param_group_index]
        adam = opt.optimizer.state[flat]
        h = m.hp_fragment_address
        frags = {"fp32": flat.narrow(0, h.start, h.numel)}
        frags.update({s: adam[s].narrow(0, h.start, h.numel) for s in STATES[1:]})
        a = m.lp_fragment_address
        local[name] = (a.start, a.numel, {s: t.detach().clone() for s, t in frags.items()})
    # SGD keeps no step: None.
    steps = sorted({float(s["step"]) for s in opt.optimizer.state.values() if "step" in s})
    everyone = [None] * dist.get_world_size()
    torch.distributed.all_gather_object(everyone, (local, steps))
    full = {}
    for name, p in engine.module.named_parameters():
        bufs = {s: torch.full((p.numel(),), float("nan")) for s in STATES}
        hits = torch.zeros(p.numel(), dtype=torch.int32)
        for rank_local, _ in everyone:
            if name in rank_local:
                start, numel, frags = rank_local[name]
                for s in STATES:
                    bufs[s][start:start + numel] = frags[s]
                hits[start:start + numel] += 1
        assert bool((hits == 1).all()), f"{name}: ZeRO fragments do not cover it exactly once"
        full[name] = {s: bufs[s].reshape(p.shape) for s in STATES}
    all_steps = sorted({s for _, st in everyone for s in st})
    if OPTIMIZER == "sgd":
        assert not all_steps, f"SGD state holds a step: {all_steps}"
        return full, None
    assert len(all_steps) == 1, f"ranks disagree on the Adam step: {all_steps}"
    return full, all_steps[0]


# ---------------------------------------------------------------------------------------------
# train


def _train_rank(rank, dp, zero, work, sub_group_size=None):
    engine = make_engine(dp, zero, universal=False, sub_group_size=sub_group_size)
    losses = {}
    for step in range(1, LAST_STEP + 1):
        losses[step] = train_step(engine, step, rank, dp)
        if step == SAVE_STEP:
            # A plain DeepSpeed client (as HF Trainer): no client_state, so no
            # universal_checkpoint_info in the files.
            engine.save_checkpoint(os.path.join(work, "ckpt"))
            truth, adam_step = gather_state(engine)
            if rank == 0:
                torch.save({"states": truth, "step": adam_step}, os.path.join(work, "truth.pt"))
    if rank == 0:
        with open(os.path.join(work, "losses.json"), "w") as f:
            json.dump({"dp": dp, "zero": zero, "sub_group_size": sub_group_size,
                       "save_step": SAVE_STEP, "losses": losses}, f, indent=1)


def cmd_train(a):
    if os.path.exists(a.work):
        shutil.rmtree(a.work)
    os.makedirs(a.work)
    run_ranks(_train_rank, a.dp, a.zero, a.work, a.sub_group_size)
    losses = load_losses(a.work)
    print(f"trained dp={a.dp} zero={a.zero} sub_group_size={a.sub_group_size}: checkpoint "
          f"{tag_dir(a.work)}, losses", " ".join(f"{losses[s]:.6f}" for s in sorted(losses)))
    if a.sub_group_size:
        # The point of the run: the checkpoint really has several sub-groups per rank.
        files = sorted(f for f in os.listdir(tag_dir(a.work)) if f.endswith("_optim_states.pt"))
        sd = torch.load(os.path.join(tag_dir(a.work), files[0]))["optimizer_state_dict"]
        n = len(sd["fp32_flat_groups"])
        print(f"{files[0]}: {n} sub-groups (fp32_flat_groups)")
        assert n > 2, f"sub_group_size {a.sub_group_size} gave only {n} sub-groups"
    assert losses[LAST_STEP] < losses[1], "the run did not learn; the loss comparison would be weak"


def load_losses(work):
    with open(os.path.join(work, "losses.json")) as f:
        return {int(k): v for k, v in json.load(f)["losses"].items()}


def tag_dir(work):
    return os.path.join(work, "ckpt", f"global_step{SAVE_STEP}")


# ---------------------------------------------------------------------------------------------
# Comparisons


class Mismatches:
    """Collects every difference before failing, so one run names all of them."""

    def __init__(self):
        self.lines = []

    def tensor(self, what, got, want):
        if got is None:
            self.lines.append(f"{what}: missing")
            return
        got, want = torch.as_tensor(got), torch.as_tensor(want)
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            self.lines.append(f"{what}: {got.dtype}{tuple(got.shape)} != "
                              f"{want.dtype}{tuple(want.shape)}")
            return
        g = got.contiguous().view(torch.int32) if got.dtype == torch.float32 else got
        w = want.contiguous().view(torch.int32) if want.dtype == torch.float32 else want
        if not torch.equal(g, w):
            bad = (g != w)
            diff = (got.double() - want.double()).abs()
            self.lines.append(f"{what}: {int(bad.sum())} of {bad.numel()} elements differ in bits, "
                              f"max |diff| {float(diff[bad].max()):.3g}")

    def add(self, line):
        self.lines.append(line)

    def check(self, title):
        if self.lines:
            print(f"FAIL {title}: {len(self.lines)} mismatches")
            for line in self.lines:
                print("  " + line)
            sys.exit(1)
        print(f"ok {title}")


def run_ds_to_universal(src_tag, out, inject_missing_state):
    """DeepSpeed's own converter, in-process (one worker: the files are tiny). DeepSpeed 0.14.4
    refuses a checkpoint without universal_checkpoint_info, which plain DeepSpeed clients (as HF
    Trainer) do not save. Its `--inject_missing_state` (PR #5608, first in DeepSpeed 0.14.5) only
    sets that info to {universal_checkpoint_version} when it is missing; inject_missing_state does
    exactly that, in the converter's own check; a newer DeepSpeed (tools/peer-dsu-requirements.txt)
    is given the flag itself."""
    import_deepspeed()
    from deepspeed.checkpoint import ds_to_universal as dtu
    from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO,
                                                UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                UNIVERSAL_CHECKPOINT_VERSION_VALUE)

    def check(ds_checkpoint):
        if ds_checkpoint.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO) is None:
            ds_checkpoint.global_state[UNIVERSAL_CHECKPOINT_INFO] = {
                UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}

    if inject_missing_state and not hasattr(dtu, "_inject_missing_state"):  # 0.14.4: no flag
        dtu._check_for_required_state = check
    args = argparse.Namespace(input_folder=src_tag, output_folder=out, num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=inject_missing_state)
    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            dtu.main(args)
        except Exception:
            sys.stdout.write(log.getvalue())
            raise


def read_ucp_universal(path):
    """ucp's universal checkpoint (manifest.json + one HDF5 file per parameter), through h5py."""
    import h5py
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    out = {}
    for p in manifest["params"]:
        with h5py.File(os.path.join(path, p["file"]), "r") as h:
            out[p["name"]] = {s: torch.from_numpy(h[s][()]) for s in STATES if s in h}
    return out


def read_ds_universal(path, flat=None):
    """A DeepSpeed universal folder: zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt ('param'), step.pt.
    The DP-only ZeRO-3 path of DeepSpeed >= 0.14.5's converter saves the merged 1-dim tensor itself
    (no dict, no shape); those are read as they are, and their names added to the set `flat`."""
    zero = os.path.join(path, "zero")
    out, steps = {}, {}
    for name in sorted(os.listdir(zero)):
        d = os.path.join(zero, name)
        if not os.path.isdir(d):
            continue
        out[name] = {}
        for s in STATES:
            if os.path.exists(os.path.join(d, f"{s}.pt")):
                sd = torch.load(os.path.join(d, f"{s}.pt"))
                if torch.is_tensor(sd):
                    assert flat is not None, f"{d}/{s}.pt: a bare tensor, not {{'param': ...}}"
                    flat.add(name)
                    out[name][s] = sd.detach()
                else:
                    out[name][s] = sd["param"].detach()
        if os.path.exists(os.path.join(d, "step.pt")):
            steps[name] = float(torch.load(os.path.join(d, "step.pt")))
    return out, steps


def compare_states(mm, label, got, want):
    for name in sorted(set(got) | set(want)):
        if name not in got:
            mm.add(f"{label}: parameter {name} missing")
        elif name not in want:
            mm.add(f"{label}: unexpected parameter {name}")
        else:
            for s in sorted(set(got[name]) | set(want[name])):
                if s not in want[name]:
                    mm.add(f"{label} {name}/{s}: unexpected state")
                else:
                    mm.tensor(f"{label} {name}/{s}", got[name].get(s), want[name][s])


# ---------------------------------------------------------------------------------------------
# extract: ucp reads what DeepSpeed writes


def ds_universal(work, out):
    """DeepSpeed's universal checkpoint of the run's checkpoint, in out/global_step<K>_universal
    (with out/latest_universal, as ds_to_universal writes it)."""
    folder = os.path.join(out, f"global_step{SAVE_STEP}_universal")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    run_ds_to_universal(tag_dir(work), folder, inject_missing_state=True)
    return folder


def cmd_ds_universal(a):
    print(f"ds_to_universal wrote {ds_universal(a.work, a.out)}")


def cmd_extract(a):
    truth = torch.load(os.path.join(a.work, "truth.pt"))
    want = truth["states"]
    zero3 = json.load(open(os.path.join(a.work, "losses.json")))["zero"] == 3
    # DeepSpeed 0.14.4's converter reads Adam's states only (DeepSpeed #8608): for SGD ucp's
    # states are compared with the engine's own, as for ZeRO-3.
    engine_only = zero3 or OPTIMIZER != "adamw"
    mm = Mismatches()
    # DeepSpeed's universal converter and its fp32 exporter, on the engine's own files. The
    # converter of 0.14.4 has no ZeRO-3 path (it came in 0.14.5, PR #5475): ucp's optimizer states
    # are then compared with the engine's own, gathered when it saved (and with a current
    # DeepSpeed's converter by dtu-vs-ucp, from a venv of its own).
    if not engine_only:
        ds, ds_steps = read_ds_universal(ds_universal(a.work, a.out))
        compare_states(mm, "ds_to_universal vs engine", ds, want)
        for name, st in ds_steps.items():
            if st != truth["step"]:
                mm.add(f"ds_to_universal {name}/step.pt: {st} != engine Adam step {truth['step']}")
    import_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    with contextlib.redirect_stdout(io.StringIO()):
        fp32 = get_fp32_state_dict_from_zero_checkpoint(os.path.join(a.work, "ckpt"))
    compare_states(mm, "zero_to_fp32 vs engine", {n: {"fp32": t} for n, t in fp32.items()},
                   {n: {"fp32": s["fp32"]} for n, s in want.items()})
    mm.check("DeepSpeed's own readers agree with the engine's state at the checkpoint")

    # ucp's extraction: every state bitwise equal to DeepSpeed's converter, fp32 to zero_to_fp32,
    # and the optimizer step the engine had.
    ucp = read_ucp_universal(a.ucp)
    with open(os.path.join(a.ucp, "manifest.json")) as f:
        ucp_step = json.load(f).get("step")
    # An optimizer without a step (SGD): the engine's global_steps.
    want_step = truth["step"] if truth["step"] is not None else SAVE_STEP
    if ucp_step != want_step:
        mm.add(f"ucp extract manifest.json step: {ucp_step} != engine step {want_step}")
    if OPTIMIZER != "adamw":
        with open(os.path.join(a.ucp, "manifest.json")) as f:
            ucp_states = json.load(f)["optimizer"]["states"]
        if tuple(ucp_states) != STATES:
            mm.add(f"ucp extract manifest.json optimizer states {ucp_states} != {list(STATES)}")
    if engine_only:
        compare_states(mm, "ucp extract vs engine", ucp, want)
    else:
        compare_states(mm, "ucp extract vs ds_to_universal", ucp, ds)
    compare_states(mm, "ucp extract fp32 vs zero_to_fp32",
                   {n: {"fp32": s.get("fp32")} for n, s in ucp.items()},
                   {n: {"fp32": t} for n, t in fp32.items()})
    mm.check(f"ucp extract {a.ucp} == {'the engine' if engine_only else 'ds_to_universal'} == "
             f"zero_to_fp32 ({len(want)} parameters x {len(STATES)} states)")


# ---------------------------------------------------------------------------------------------
# dtu-vs-ucp: a newer DeepSpeed's ds_to_universal (tools/peer-dsu-requirements.txt; 0.14.4's has no
# ZeRO-3 path) and ucp extract agree on a ZeRO-3 checkpoint


def ds_optimizer_steps(folder):
    """The Adam steps of a ds_to_universal folder: every zero/<name>/step.pt (ZeRO-1/2), else the
    torch optimizer state its ZeRO-3 path copies into zero/optimizer_state.pt (rank 0's file)."""
    _, steps = read_ds_universal(folder, flat=set())
    if steps:
        return set(steps.values())
    osd = torch.load(os.path.join(folder, "zero", "optimizer_state.pt"))
    return {float(st["step"]) for st in osd["optimizer_state_dict"]["state"].values()}


def cmd_dtu_vs_ucp(a):
    """DeepSpeed's ds_to_universal on T and ucp's extraction U of T: every fp32 / exp_avg /
    exp_avg_sq bitwise equal (names mapped to ucp's canonical ones, Megatron-DeepSpeed's by
    canonical_name), and the Adam step equal. With --truth (the run's truth.pt, or a fixture's
    expected*.pt) the converter's output is also compared with it, so that a disagreement says
    which side is wrong."""
    shutil.rmtree(a.out, ignore_errors=True)
    os.makedirs(a.out)
    folder = os.path.join(a.out, os.path.basename(os.path.normpath(a.tag)) + "_universal")
    megatron_enums_importable()  # the Megatron fixture's args (the converter copies them)
    # No --inject_missing_state: the converter's ZeRO-3 path reads universal_checkpoint_info only
    # at tp > 1, which Megatron-DeepSpeed saves, and a plain client (tp=1) needs none.
    run_ds_to_universal(a.tag, folder, inject_missing_state=False)
    flat = set()
    got, _ = read_ds_universal(folder, flat)
    want = read_ucp_universal(a.ucp)
    layers = 1 + max(int(n.split(".")[1]) for n in want if n.startswith("layers."))
    got = {canonical_name(n, layers): st for n, st in got.items()}
    flat = {canonical_name(n, layers) for n in flat}
    mm = Mismatches()
    for name in flat & set(want):
        # The DP-only path saves the parameter flat: compared at ucp's shape (row-major, so the
        # same elements in the same order) once the element counts agree.
        for s, t in got[name].items():
            w = want[name].get(s)
            if w is not None and t.dim() == 1 and t.numel() == w.numel():
                got[name][s] = t.view(w.shape)
    compare_states(mm, "ds_to_universal vs ucp extract", got, want)
    with open(os.path.join(a.ucp, "manifest.json")) as f:
        ucp_step = json.load(f).get("step")
    ds_steps = ds_optimizer_steps(folder)
    if ds_steps != {ucp_step}:
        mm.add(f"ds_to_universal step {sorted(ds_steps)} != ucp extract manifest step {ucp_step}")
    if a.truth:
        truth = torch.load(a.truth)
        truth = truth["states"] if "states" in truth else truth
        compare_states(mm, "ds_to_universal vs truth", got,
                       {n: {s: st[s] for s in STATES} for n, st in truth.items()})
    version = importlib.metadata.version("deepspeed")
    mm.check(f"ds_to_universal {version} == ucp extract ({len(want)} parameters x {len(STATES)} "
             f"states, step {ucp_step}{'; its files flat' if flat else ''})"
             + (f" == {os.path.basename(a.truth)}" if a.truth else ""))


# ---------------------------------------------------------------------------------------------
# fixtures: ucp's committed DeepSpeed fixtures go through DeepSpeed's real converter


# Every fixture folder of tests/data/deepspeed and the truth its model was cut from (the rest of
# the folder, models/ and SHA256SUMS, is not a checkpoint). A folder holding a `latest` file that
# is not listed here fails the test, so a new fixture cannot go unchecked.
FIXTURES = {
    "megatron_tp2_pp1_dp2_bf16": "expected.pt",
    "megatron_tp1_pp2_dp2_bf16": "expected.pt",
    "megatron_tp2_pp2_sp2_fp16_zero1": "expected.pt",
    "deepspeed_tp1_pp1_dp4_fp16_zero2": "expected.pt",
    "megatron_llama_tp2_pp2_dp2_bf16": "expected_llama.pt",
    "megatron_llama_tp2_pp1_dp2_fp16_zero1": "expected_llama.pt",
    "megatron_llama_nested_tp2_pp1_dp2_fp16_zero1": "expected_llama.pt",
    "megatron_llama_zero3_tp2_dp3_bf16": "expected_llama.pt",
    "deepspeed_mixtral_tp1_pp1_dp2_bf16_zero1": "expected_mixtral.pt",
    "megatron_qkv441_tp2_pp1_dp2_bf16": "expected.pt",
    "megatron_qkvblocks_tp1_pp1_dp2_fp16_zero1": "expected.pt",
    "megatron_sgd_tp2_pp1_dp2_fp16_zero2": "expected_sgd.pt",
    "megatron_uneven_tp2_pp2_dp2_bf16": "expected_uneven.pt",
    "deepspeed_moe_tp1_pp1_dp4_ep2_fp32_zero1": "expected_moe.pt",
}
# Native DeepSpeed-MoE checkpoints (expert files, written by the real engine: tests/peer/
# ds_moe_peer.py): DeepSpeed 0.14.4's ds_to_universal knows no expert files (DeepSpeed #5716) and
# asserts on the missing layer_* files; ucp reads them (cli_deepspeed_moe_test, and
# peer_ucp_reads_deepspeed_moe_* against the engine's own state).
NATIVE_MOE_FIXTURES = {"deepspeed_moe_tp1_pp1_dp4_ep2_fp32_zero1"}
# Fixtures of optimizers other than Adam (torch SGD's momentum_buffer): DeepSpeed's converter
# hard-codes exp_avg / exp_avg_sq (DeepSpeed issue #8608), so it must refuse them with that
# KeyError; ucp reads them (api_deepspeed_source_test) and peer_ucp_sgd runs the real engine.
NON_ADAM_FIXTURES = {"megatron_sgd_tp2_pp1_dp2_fp16_zero2"}
# Fixtures whose fused QKV is in Megatron-DeepSpeed's row order since PR #441 (each tp rank's
# rows [Q_r | K_r | V_r]): name -> (tp, heads). DeepSpeed's converter concatenates the TP shards
# as stored (it knows no sub-parameters of the QKV), so its output is the truth's per-head
# [q_h | k_h | v_h] rows rearranged so, rank by rank.
QKV_RANK_BLOCKS = {
    "megatron_qkv441_tp2_pp1_dp2_bf16": (2, 4),
    "megatron_qkvblocks_tp1_pp1_dp2_fp16_zero1": (1, 4),
}


def rank_blocks(t, tp, heads):
    """A multi-head fused QKV (rows per head [q | k | v]) as post-#441 shards concatenated."""
    d = t.shape[0] // (3 * heads)
    rest = tuple(t.shape[1:])
    return torch.cat([c.reshape(heads // tp, 3, d, *rest).transpose(0, 1).reshape(-1, *rest)
                      for c in t.chunk(tp, 0)])


def canonical_name(ds_name, layers):
    """Megatron-DeepSpeed's GPTModelPipe / GPTModel names -> ucp's canonical names (plain
    DeepSpeed names already are canonical). Written from Megatron's conventions, independently of
    the fixture generator's own map: GPTModelPipe's spec index 1 is the embedding (a tied module,
    or plain `1.` when untied), 2..L+1 the layers, L+2 the final norm, L+3 the untied LM head."""
    m = re.fullmatch(r"tied_modules\.embed\.(.+)", ds_name)
    if m:
        return "embedding." + m.group(1)
    m = re.fullmatch(r"(\d+)\.(.+)", ds_name)
    if m:
        idx, rest = int(m.group(1)), m.group(2)
        if idx == 1:
            return "embedding." + rest
        if idx == layers + 2:
            return "final_layernorm." + rest
        if idx == layers + 3 and rest.startswith("lm_head."):
            return "output_layer." + rest[len("lm_head."):]
        return f"layers.{idx - 2}.{rest}"
    for prefix, repl in (("language_model.encoder.", ""), ("language_model.", "")):
        if ds_name.startswith(prefix):
            return repl + ds_name[len(prefix):]
    return ds_name


def fixture_folders(data):
    """FIXTURES, after checking it is exactly the set of checkpoint folders (those with `latest`)."""
    found = {n for n in os.listdir(data) if os.path.isfile(os.path.join(data, n, "latest"))}
    unlisted, missing = sorted(found - set(FIXTURES)), sorted(set(FIXTURES) - found)
    if unlisted or missing:
        sys.exit(f"tests/peer/ds_peer.py FIXTURES is not the fixture set of {data}: "
                 f"unlisted {unlisted}, missing {missing}")
    return sorted(FIXTURES)


def megatron_enums_importable():
    """The Megatron fixtures' `args` Namespace holds megatron.core.enums.ModelType, as every real
    Megatron-DeepSpeed run's does (megatron/training.py sets args.model_type), so torch.load of
    their model states needs Megatron importable; ds_to_universal is normally run next to a
    Megatron-DeepSpeed checkout. Megatron is not in the peer venv (it is not on PyPI), so the one
    class unpickling needs is registered under its module name, with Megatron-DeepSpeed's members
    (HEAD 4efb479d). The converter only carries args along; it never reads model_type."""
    try:
        import megatron.core.enums  # noqa: F401
        return
    except ImportError:
        pass
    import enum
    import types

    class ModelType(enum.Enum):
        encoder_or_decoder = 1
        encoder_and_decoder = 2
        retro_encoder = 3
        retro_decoder = 4

    for mod in ("megatron", "megatron.core", "megatron.core.enums"):
        sys.modules.setdefault(mod, types.ModuleType(mod))
    sys.modules["megatron"].core = sys.modules["megatron.core"]
    sys.modules["megatron.core"].enums = sys.modules["megatron.core.enums"]
    ModelType.__module__, ModelType.__qualname__ = "megatron.core.enums", "ModelType"
    sys.modules["megatron.core.enums"].ModelType = ModelType


def zero3_fixture_fp32(tag, layers):
    """A ZeRO-3 fixture's fp32 masters through DeepSpeed's zero_to_fp32, which reads one TP rank
    (its mp_rank_00 files): each rank's files are linked into a folder of their own under rank
    00's names, and the TP shards merged by Megatron's cuts for the LLaMA-style model (norms
    replicated, attention dense / dense_4h_to_h on dim 1, SwiGLU [gate; up] per rank, the rest on
    dim 0, the vocabulary padding stripped below), written here independently of ucp."""
    import_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    ranks = sorted({int(m.group(1)) for f in os.listdir(tag)
                    for m in [re.search(r"_mp_rank_(\d+)_", f)] if m})
    shards = []
    for r in ranks:
        with tempfile.TemporaryDirectory() as tmp:
            os.makedirs(os.path.join(tmp, "rank"))
            for f in os.listdir(tag):
                if f"_mp_rank_{r:02d}_" in f:
                    os.symlink(os.path.abspath(os.path.join(tag, f)), os.path.join(
                        tmp, "rank", f.replace(f"_mp_rank_{r:02d}_", "_mp_rank_00_")))
            with contextlib.redirect_stdout(io.StringIO()):
                shards.append(get_fp32_state_dict_from_zero_checkpoint(tmp, tag="rank"))
    out = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        canon = canonical_name(name, layers)
        if "layernorm" in canon:
            assert all(torch.equal(parts[0], p) for p in parts), f"{name}: TP replicas differ"
            full = parts[0]
        elif canon.endswith("self_attention.dense.weight") or "dense_4h_to_h" in canon:
            full = torch.cat(parts, 1)
        elif "dense_h_to_4h" in canon:
            full = torch.cat([p.chunk(2)[0] for p in parts] + [p.chunk(2)[1] for p in parts])
        else:
            full = torch.cat(parts, 0)
        out[canon] = {"fp32": full}
    return out


def refused_fixture(data, name, failed, error, why):
    """DeepSpeed's ds_to_universal on a fixture it cannot convert must stop with `error`, whose
    message contains `why` (a change in DeepSpeed then shows as a failure to look at)."""
    with open(os.path.join(data, name, "latest")) as f:
        tag = os.path.join(data, name, f.read().strip())
    with tempfile.TemporaryDirectory() as tmp:
        try:
            run_ds_to_universal(tag, os.path.join(tmp, "universal"), inject_missing_state=True)
            print(f"FAIL {name}: ds_to_universal converted it; move it out of the refused "
                  f"fixtures and compare its output")
            failed.append(name)
        except error as e:
            if why not in str(e):
                print(f"FAIL {name}: ds_to_universal: {type(e).__name__} {e}, not about {why}")
                failed.append(name)
            else:
                print(f"ok {name}: ds_to_universal refuses it ({type(e).__name__} {e})")


def cmd_fixtures(a):
    failed = []
    megatron_enums_importable()
    for name in fixture_folders(a.data):
        # ds_to_universal yields the fp32 masters and Adam moments only (no model weights): those
        # are compared, bitwise, with the truth's; its model_bf16 / model_fp16 are not used here.
        if name in NON_ADAM_FIXTURES:  # Adam's states hard-coded (DeepSpeed #8608)
            refused_fixture(a.data, name, failed, KeyError, "exp_avg")
            continue
        if name in NATIVE_MOE_FIXTURES:  # no expert files known (DeepSpeed #5716)
            refused_fixture(a.data, name, failed, AssertionError, "layer_01")
            continue
        expected = {n: {s: st[s] for s in STATES}
                    for n, st in torch.load(os.path.join(a.data, FIXTURES[name])).items()}
        if name in QKV_RANK_BLOCKS:
            for n in expected:
                if "query_key_value" in n:
                    expected[n] = {s: rank_blocks(t, *QKV_RANK_BLOCKS[name])
                                   for s, t in expected[n].items()}
        layers = 1 + max(int(n.split(".")[1]) for n in expected if n.startswith("layers."))
        folder = os.path.join(a.data, name)
        with open(os.path.join(folder, "latest")) as f:
            tag = os.path.join(folder, f.read().strip())
        mm = Mismatches()
        if any(f.startswith("zero_pp_rank_") and f.endswith("_model_states.pt")
               for f in os.listdir(tag)):
            # DeepSpeed 0.14.4's ds_to_universal has no ZeRO-3 path (0.14.5's PR #5475 added a
            # DP-only one): its zero_to_fp32 reads the fp32 masters. (A current converter, which
            # also merges ZeRO-3's TP shards, is compared with ucp on this fixture by dtu-vs-ucp.)
            got = zero3_fixture_fp32(tag, layers)
            for n, st in got.items():
                want = expected[n]["fp32"]
                vocab = n.endswith("word_embeddings.weight") or n.startswith("output_layer.")
                mm.tensor(f"{name} {n}/fp32", st["fp32"][:want.shape[0]] if vocab else st["fp32"],
                          want)
            if set(got) != set(expected):
                mm.add(f"{name}: parameters {sorted(set(got) ^ set(expected))} on one side only")
            if mm.lines:
                print(f"FAIL {name}: DeepSpeed's zero_to_fp32 differs from {FIXTURES[name]}:")
                for line in mm.lines:
                    print("  " + line)
                failed.append(name)
            else:
                print(f"ok {name}: zero_to_fp32 per TP rank, merged, == {FIXTURES[name]} fp32 "
                      f"({len(got)} parameters)")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "universal")
            try:
                # Only the plain DeepSpeed fixtures lack universal_checkpoint_info; the Megatron
                # ones carry Megatron-DeepSpeed's own, which the injection leaves alone.
                run_ds_to_universal(tag, out, inject_missing_state=True)
            except Exception as e:  # the converter asserts: name the fixture and go on
                print(f"FAIL ds_to_universal on {name}: {type(e).__name__}: {e}")
                failed.append(name)
                continue
            got, _ = read_ds_universal(out)
        compare_states(mm, name, {canonical_name(n, layers): s for n, s in got.items()}, expected)
        if mm.lines:
            print(f"FAIL {name}: DeepSpeed's ds_to_universal output differs from {FIXTURES[name]}:")
            for line in mm.lines:
                print("  " + line)
            failed.append(name)
        else:
            print(f"ok {name}: ds_to_universal output == {FIXTURES[name]} "
                  f"({len(got)} parameters x {len(STATES)} states)")
    if failed:
        sys.exit(f"{len(failed)} fixture(s) not read as expected by DeepSpeed: {', '.join(failed)}")


# ---------------------------------------------------------------------------------------------
# resume: DeepSpeed reads what ucp writes (and, as the control, what it wrote itself)


def _resume_rank(rank, dp, zero, mode, load, wants, want_step, result):
    engine = make_engine(dp, zero, universal=(mode == "universal"))
    path, _ = engine.load_checkpoint(load)
    assert path is not None, f"DeepSpeed found no checkpoint to load in {load}"
    got, got_step = gather_state(engine)
    mm = Mismatches()
    if rank == 0:
        for label, want in wants.items():
            compare_states(mm, f"loaded engine vs {label}", got, want)
        if got_step != want_step:
            mm.add(f"loaded engine Adam step {got_step} != {want_step} at the checkpoint")
        if engine.global_steps != SAVE_STEP:
            mm.add(f"loaded engine global_steps {engine.global_steps} != {SAVE_STEP}")
    masters = wants["the engine's state at the checkpoint"]
    # An fp32 run: module weights = masters. ZeRO-3's are partitioned: gathered (a collective of
    # every rank) for the comparison.
    params = list(engine.module.named_parameters())
    gathered = contextlib.nullcontext()
    if zero == 3:
        import deepspeed
        gathered = deepspeed.zero.GatheredParameters([p for _, p in params])
    with gathered:
        if rank == 0:
            for name, p in params:
                mm.tensor(f"loaded module weight {name}", p.detach().clone(),
                          masters[name]["fp32"])
    losses = {step: train_step(engine, step, rank, dp)
              for step in range(SAVE_STEP + 1, LAST_STEP + 1)}
    if rank == 0:
        torch.save({"mismatches": mm.lines, "losses": losses}, result)


def cmd_resume(a):
    """A fresh engine at dp=a.dp loads a.load (mode universal: load_universal, which follows
    latest_universal; mode zero: DeepSpeed's own ZeRO load, which follows latest and needs the
    saved dp size). Its fp32 masters, Adam moments and step must equal, bitwise, the state the
    training run had when it saved (and ucp's universal checkpoint, with --ucp); then it trains
    steps SAVE_STEP+1..LAST_STEP, whose losses must follow the uninterrupted run: exactly at the
    saved dp size, within LOSS_RTOL_OTHER_DP at another."""
    with open(os.path.join(a.work, "losses.json")) as f:
        run = json.load(f)
    truth = torch.load(os.path.join(a.work, "truth.pt"))
    wants = {"the engine's state at the checkpoint": truth["states"]}
    if a.ucp:
        wants[f"ucp universal {a.ucp}"] = read_ucp_universal(a.ucp)
    fd, result = tempfile.mkstemp(prefix="resume_", suffix=".pt", dir=a.work)
    os.close(fd)
    try:
        run_ranks(_resume_rank, a.dp, a.zero or run["zero"], a.mode, a.load, wants, truth["step"],
                  result)
        r = torch.load(result)
    finally:
        os.remove(result)
    mm = Mismatches()
    for line in r["mismatches"]:
        mm.add(line)
    mm.check(f"DeepSpeed at dp={a.dp} loaded {a.load} ({a.mode}) with the saved state, bitwise")
    ref = load_losses(a.work)
    # The saved dp size: the same partitions and reductions in the same order, so the same bits.
    rtol = 0.0 if a.dp == run["dp"] else LOSS_RTOL_OTHER_DP
    worst = 0.0
    for step, loss in sorted(r["losses"].items()):
        rel = abs(loss - ref[step]) / abs(ref[step])
        worst = max(worst, rel)
        print(f"  step {step}: resumed {loss:.9f}  uninterrupted {ref[step]:.9f}  "
              f"rel diff {rel:.3g}")
    print(f"max relative loss difference over steps {SAVE_STEP + 1}..{LAST_STEP} at dp={a.dp} "
          f"(saved at dp={run['dp']}): {worst:.3g}, tolerance {rtol:g}")
    if worst > rtol:
        sys.exit(f"FAIL: resumed losses leave the uninterrupted run by {worst:.3g} > {rtol:g}")
    print(f"ok DeepSpeed at dp={a.dp} continues the run from {a.load}")


# ---------------------------------------------------------------------------------------------
# reads-ucp: DeepSpeed's own converter reads what ucp's --format deepspeed wrote


def engine_to_canonical(name, layers):
    """GPTModelPipe (tied or untied), GPTModel and plain DeepSpeed names -> ucp's canonical names,
    from Megatron's conventions (deepspeed_ucp.md 2.2, 5)."""
    m = re.fullmatch(r"(?:tied_modules\.embed|1)\.((?:word|position)_embeddings\..+)", name)
    if m:
        return "embedding." + m.group(1)
    m = re.fullmatch(r"\d+\.lm_head\.(.+)", name)
    if m:
        return "output_layer." + m.group(1)
    m = re.fullmatch(r"(\d+)\.(.+)", name)
    if m:
        idx, rest = int(m.group(1)), m.group(2)
        return f"final_layernorm.{rest}" if idx == layers + 2 else f"layers.{idx - 2}.{rest}"
    for prefix in ("language_model.encoder.", "language_model."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def cmd_reads_ucp(a):
    """ds_to_universal needs no injected state here: ucp writes universal_checkpoint_info made
    from its own rules for the written tp (replicated, row-parallel, SwiGLU, vocabulary and
    pipeline-replicated parameters by exact name)."""
    shutil.rmtree(a.out, ignore_errors=True)
    os.makedirs(a.out)
    folder = os.path.join(a.out, "universal")
    run_ds_to_universal(a.tag, folder, inject_missing_state=False)
    got, steps = read_ds_universal(folder)
    want = read_ucp_universal(a.ucp)
    with open(os.path.join(a.ucp, "manifest.json")) as f:
        want_step = json.load(f).get("step")
    layers = 1 + max(int(n.split(".")[1]) for n in want if n.startswith("layers."))
    mm = Mismatches()
    compare_states(mm, "ds_to_universal vs ucp universal",
                   {engine_to_canonical(n, layers): s for n, s in got.items()}, want)
    for name, st in steps.items():
        if st != want_step:
            mm.add(f"ds_to_universal {name}/step.pt: {st} != the universal step {want_step}")
    mm.check(f"DeepSpeed's ds_to_universal on {a.tag} == {a.ucp} ({len(got)} parameters x "
             f"{len(STATES)} states, step {want_step})")


# ---------------------------------------------------------------------------------------------
# universal-loader: DeepSpeed's universal loader cuts each tp rank's slice from ucp's
# --format deepspeed-universal output


def ds_rank_slices(tag):
    """Every (pp, tp) rank's fp32 / Adam slices of a dp=1 ZeRO-1/2 or BF16 checkpoint ucp wrote
    with --format deepspeed, read as DeepSpeed lays them out (deepspeed_ucp.md 2.3, 4): each
    parameter's one fragment of the flat partition (param_slice_mappings), at its param_shapes
    shape. Returns ({tp rank: {engine name: {state: tensor}}}, tp)."""
    files = os.listdir(tag)
    model_files = sorted(f for f in files if re.fullmatch(r"mp_rank_\d+_model_states\.pt", f))
    optim_re = r"(?:bf16_)?zero_pp_rank_0_mp_rank_(\d+)_optim_states\.pt"
    optim = {int(m.group(1)): f for f in files for m in [re.fullmatch(optim_re, f)] if m}
    assert optim and not any(re.search(r"zero_pp_rank_[1-9]", f) for f in os.listdir(tag)), \
        f"{tag}: not a dp=1 checkpoint"
    out, tp = {}, None
    for i, mf in enumerate(model_files):
        ms = torch.load(os.path.join(tag, mf))
        tp = ms["checkpoint_parallel_dimensions"]["tp_degree"] if tp is None else tp
        osd = torch.load(os.path.join(tag, optim[i]))["optimizer_state_dict"]
        rank = out.setdefault(i % tp, {})
        for g, shapes in enumerate(ms["param_shapes"]):
            flat = {"fp32": osd["single_partition_of_fp32_groups"][g]}
            for st in ("exp_avg", "exp_avg_sq"):
                flat[st] = osd["base_optimizer_state"]["state"][g][st]
            for name, shape in shapes.items():
                frag = osd["param_slice_mappings"][g][name]
                assert frag.numel == math.prod(shape), f"{tag} {name}: split over dp ranks"
                rank[name] = {st: t.narrow(0, frag.start, frag.numel).view(shape).clone()
                              for st, t in flat.items()}
    return out, tp


def load_with_deepspeed(folder, shape, tp_rank, tp, start, numel):
    """DeepSpeed's load_hp_checkpoint_state, as its ZeRO optimizer calls it on a low-precision
    parameter of the rank's shape whose partition holds [start, start+numel) of the rank's
    flattened slice: the fp32 fragment it copies and the Adam fragments it stashes, and the step."""
    import_deepspeed()
    from deepspeed.checkpoint.universal_checkpoint import load_hp_checkpoint_state
    from deepspeed.utils.tensor_fragment import fragment_address

    class Mapping:  # the members of tensor_fragment.tensor_fragment the loader touches
        def __init__(self):
            self.lp_fragment_address = fragment_address(numel=numel, start=start)
            self.hp = torch.full((numel,), float("nan"))
            self.optim_fragment = {}

        def get_hp_fragment(self):
            return self.hp

    lp = torch.nn.Parameter(torch.empty(shape, dtype=torch.bfloat16), requires_grad=False)
    lp._hp_mapping = Mapping()
    step = load_hp_checkpoint_state(lp, folder, tp_rank, tp)
    return {"fp32": lp._hp_mapping.hp, **lp._hp_mapping.optim_fragment}, step


def same_as_ds_to_universal(mm, dsu, tag, out, layers):
    """DeepSpeed's ds_to_universal on tag (into out) writes the folders of dsu: the same
    parameters, and in each state file the same keys besides 'param' and 'param' bitwise."""
    shutil.rmtree(out, ignore_errors=True)
    run_ds_to_universal(tag, out, inject_missing_state=False)

    def folders(root):
        z = os.path.join(root, "zero")
        return {engine_to_canonical(f, layers): os.path.join(z, f) for f in os.listdir(z)
                if os.path.isdir(os.path.join(z, f))}

    ours, dtu = folders(dsu), folders(out)
    if set(dtu) != set(ours):
        mm.add(f"ds_to_universal: parameters on one side only: {sorted(set(dtu) ^ set(ours))}")
    for name in sorted(set(dtu) & set(ours)):
        for st in ("fp32", "exp_avg", "exp_avg_sq"):
            got = torch.load(os.path.join(ours[name], st + ".pt"))
            ref = torch.load(os.path.join(dtu[name], st + ".pt"))
            got_keys = sorted((k, v) for k, v in got.items() if k != "param")
            ref_keys = sorted((k, v) for k, v in ref.items() if k != "param")
            if got_keys != ref_keys:
                mm.add(f"{name} {st}.pt: keys {got_keys} != ds_to_universal's {ref_keys}")
            mm.tensor(f"{name} {st}.pt param vs ds_to_universal", got["param"], ref["param"])
    return len(ours)


def cmd_same_as_dtu(a):
    """a.dsu (ucp's --format deepspeed-universal of a DeepSpeed checkpoint's extraction) holds
    what DeepSpeed's ds_to_universal writes from that checkpoint (a.tag)."""
    megatron_enums_importable()
    with open(os.path.join(a.ucp, "manifest.json")) as f:
        manifest = json.load(f)
    layers = 1 + max(int(p["name"].split(".")[1]) for p in manifest["params"]
                     if p["name"].startswith("layers."))
    mm = Mismatches()
    n = same_as_ds_to_universal(mm, a.dsu, a.tag, a.out, layers)
    mm.check(f"ds_to_universal on {a.tag} writes the files of {a.dsu} ({n} parameters, every key "
             f"equal, 'param' bitwise)")


def cmd_universal_loader(a):
    """a.dsu: ucp's --format deepspeed-universal output; a.tag: ucp's --format deepspeed at the
    same model, tp=T, dp=1. For every parameter and tp rank, DeepSpeed's loader on the folder must
    give that rank's slices bitwise: whole, and as two ZeRO partitions' fragments (the loader's
    narrow). With --ds-to-universal, DeepSpeed's own converter on a.tag must write the same files
    (every key equal, 'param' bitwise)."""
    want, tp = ds_rank_slices(a.tag)
    with open(os.path.join(a.ucp, "manifest.json")) as f:
        manifest = json.load(f)
    want_step = manifest["step"]
    layers = 1 + max(int(p["name"].split(".")[1]) for p in manifest["params"]
                     if p["name"].startswith("layers."))
    want = {r: {engine_to_canonical(e, layers): s for e, s in names.items()}
            for r, names in want.items()}
    zero = os.path.join(a.dsu, "zero")
    folders = {engine_to_canonical(f, layers): os.path.join(zero, f) for f in os.listdir(zero)
               if os.path.isdir(os.path.join(zero, f))}
    mm = Mismatches()
    if set(folders) != set(want[0]):
        mm.add(f"parameters on one side only: {sorted(set(folders) ^ set(want[0]))}")
    kinds = {}
    for name in sorted(set(folders) & set(want[0])):
        d = torch.load(os.path.join(folders[name], "fp32.pt"))
        kinds[tuple(sorted(k for k in d if k != "param"))] = kinds.get(
            tuple(sorted(k for k in d if k != "param")), 0) + 1
        for r in range(tp):
            truth = want[r][name]
            shape, n = tuple(truth["fp32"].shape), truth["fp32"].numel()
            for start, numel in ((0, n), (0, n // 2), (n // 2, n - n // 2)):
                got, step = load_with_deepspeed(folders[name], shape, r, tp, start, numel)
                for st, t in truth.items():
                    mm.tensor(f"{name} tp rank {r} [{start}, {start + numel}) {st}",
                              got.get(st), t.flatten().narrow(0, start, numel))
                if float(step) != float(want_step):
                    mm.add(f"{name}: step {step} != {want_step}")
    print("state-file keys besides 'param' (parameters): " +
          ", ".join(f"{list(k) or 'none'} ({c})" for k, c in sorted(kinds.items())))
    for key in a.expect_key or []:
        if not any(key in k for k in kinds):
            mm.add(f"no state file holds the key {key!r}")
    if a.ds_to_universal:
        same_as_ds_to_universal(mm, a.dsu, a.tag, os.path.join(a.out, "dtu"), layers)
    mm.check(f"DeepSpeed's universal loader on {a.dsu} == the tp={tp} slices of {a.tag}"
             + (" and ds_to_universal writes the same files" if a.ds_to_universal else ""))


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--work", required=True)
    t.add_argument("--zero", type=int, choices=(1, 2, 3), required=True)
    t.add_argument("--dp", type=int, default=2)
    t.add_argument("--sub-group-size", type=int, help="ZeRO-3 sub_group_size (elements per rank)")
    d = sub.add_parser("ds-universal")
    d.add_argument("--work", required=True)
    d.add_argument("--out", required=True, help="folder for latest_universal and the checkpoint")
    e = sub.add_parser("extract")
    e.add_argument("--work", required=True)
    e.add_argument("--ucp", required=True, help="ucp extract's output for the work's checkpoint")
    e.add_argument("--out", required=True, help="folder for ds_to_universal's output")
    f = sub.add_parser("fixtures")
    f.add_argument("--data", required=True, help="tests/data/deepspeed")
    r = sub.add_parser("resume")
    r.add_argument("--work", required=True)
    r.add_argument("--load", required=True, help="the folder passed to engine.load_checkpoint")
    r.add_argument("--dp", type=int, required=True)
    r.add_argument("--mode", choices=("universal", "zero"), required=True)
    r.add_argument("--ucp", help="universal mode: ucp's universal checkpoint the files came from")
    r.add_argument("--zero", type=int, choices=(1, 2, 3), help="ZeRO stage (default: the run's)")
    u = sub.add_parser("reads-ucp")
    u.add_argument("--tag", required=True, help="a tag folder ucp wrote with --format deepspeed")
    u.add_argument("--ucp", required=True, help="the ucp universal checkpoint of the same model")
    u.add_argument("--out", required=True, help="folder for ds_to_universal's output")
    v = sub.add_parser("universal-loader")
    v.add_argument("--dsu", required=True, help="ucp's --format deepspeed-universal output")
    v.add_argument("--tag", required=True, help="ucp's --format deepspeed output, dp=1")
    v.add_argument("--ucp", required=True, help="the ucp universal checkpoint both came from")
    v.add_argument("--out", required=True, help="work folder (ds_to_universal's output)")
    v.add_argument("--ds-to-universal", action="store_true",
                   help="also compare with DeepSpeed's ds_to_universal on --tag")
    v.add_argument("--expect-key", action="append",
                   help="a key some state file must hold besides 'param' (repeatable)")
    w = sub.add_parser("same-as-dtu")
    w.add_argument("--dsu", required=True, help="ucp's --format deepspeed-universal output")
    w.add_argument("--tag", required=True, help="the DeepSpeed tag folder it was extracted from")
    w.add_argument("--ucp", required=True, help="ucp's extraction of the tag")
    w.add_argument("--out", required=True, help="folder for ds_to_universal's output")
    x = sub.add_parser("dtu-vs-ucp")
    x.add_argument("--tag", required=True, help="a ZeRO-3 tag folder (the engine's or a fixture)")
    x.add_argument("--ucp", required=True, help="ucp extract's output for the tag")
    x.add_argument("--out", required=True, help="folder for ds_to_universal's output")
    x.add_argument("--truth", help="truth.pt of the run, or the fixture's expected*.pt")
    a = p.parse_args()
    print(f"peer: torch {torch.__version__}, deepspeed {importlib.metadata.version('deepspeed')}")
    {"train": cmd_train, "ds-universal": cmd_ds_universal, "extract": cmd_extract,
     "fixtures": cmd_fixtures, "resume": cmd_resume, "reads-ucp": cmd_reads_ucp,
     "universal-loader": cmd_universal_loader, "same-as-dtu": cmd_same_as_dtu,
     "dtu-vs-ucp": cmd_dtu_vs_ucp}[a.cmd](a)


if __name__ == "__main__":
    main()
