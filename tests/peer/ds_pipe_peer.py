"""Peer test of uneven pipeline stages against the real DeepSpeed (issue 14): a PipelineModule
laid out as Megatron-DeepSpeed's GPTModelPipe (spec 0 a function, 1 the tied embedding, 2..L+1
the layers, L+2 the final norm, L+3 the tied head) with L=3 layers on pp=2 stages, cut by
partition_method='uniform': 7 specs over 2 stages give [0, 4, 7], so stage 0 holds 2 transformer
layers and stage 1 one. Run with the peer venv's python; tests/peer/peer_test.sh
(`pipe-uneven`) strings it together with the ucp CLI.

    train   --work W    pp=2 (dp=1) CPU run: checkpoint at step SAVE_STEP (W/ckpt), losses of
                        steps 1..LAST_STEP (W/losses.json), the engine's exact fp32 / Adam state
                        at the save under ucp's canonical names (W/truth.pt)
    check   --work W --ucp U
                        ucp's extraction U == the engine's state, bitwise
    resume  --work W --load L
                        a fresh engine loads L (ucp's --format deepspeed of W/ckpt): its state
                        is the saved one, bitwise, and steps SAVE_STEP+1.. give the same losses
"""

import argparse
import json
import os
import shutil
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ds_peer  # noqa: E402
from ds_peer import HEADS, HIDDEN, POSITIONS, VOCAB, Layer, Mismatches  # noqa: E402

LAYERS = 3  # gpt-pipe-peer.json
PP = 2
SAVE_STEP, LAST_STEP = 3, 6
MICRO, ACCUM = 4, 2  # 8 sequences a step
SEQ = 16
STATES = ("fp32", "exp_avg", "exp_avg_sq")


class EmbeddingPipe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = torch.nn.Embedding(POSITIONS, HIDDEN)

    @property
    def word_embeddings_weight(self):  # the tied attribute, as Megatron-DeepSpeed's EmbeddingPipe
        return self.word_embeddings.weight

    def forward(self, tokens):
        return self.word_embeddings(tokens) + self.position_embeddings(torch.arange(tokens.shape[1]))


def logits(embed, h):
    return F.linear(h, embed.word_embeddings.weight)


def loss_fn(out, labels):
    return F.cross_entropy(out.reshape(-1, VOCAB), labels.reshape(-1))


def make_engine():
    deepspeed = ds_peer.import_deepspeed()
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    torch.manual_seed(4321)
    specs = [lambda tokens: tokens,
             TiedLayerSpec("embed", EmbeddingPipe, tied_weight_attr="word_embeddings_weight")]
    specs += [LayerSpec(Layer) for _ in range(LAYERS)]
    specs += [LayerSpec(torch.nn.LayerNorm, HIDDEN),
              TiedLayerSpec("embed", EmbeddingPipe, forward_fn=logits,
                            tied_weight_attr="word_embeddings_weight")]
    # seed_layers: each layer's init from its own seed, so that every run (and either stage)
    # builds the same weights whatever the partition.
    # Megatron-DeepSpeed's topology (a `model` axis of size tp=1): its layer files are named
    # layer_XX-model_00-model_states.pt, as GPTModelPipe's.
    topo = PipeModelDataParallelTopology(num_pp=PP, num_mp=1, num_dp=1)
    model = PipelineModule(layers=specs, topology=topo, loss_fn=loss_fn,
                           partition_method="uniform", seed_layers=True, base_seed=1234)
    params = [p for p in model.parameters() if p.requires_grad]
    config = {"train_batch_size": MICRO * ACCUM, "train_micro_batch_size_per_gpu": MICRO,
              "gradient_accumulation_steps": ACCUM, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95],
                                                        "eps": 1e-8, "weight_decay": 0.1,
                                                        "torch_adam": True}},
              "zero_optimization": {"stage": 1}, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    return engine


def batches(step):
    """The micro-batches (inputs, labels) of optimizer step `step`: fixed token streams."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(ACCUM):
        t = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def canonical(name):
    return ds_peer.canonical_name(name, LAYERS)


def local_state(engine):
    """This stage's parameters' fp32 masters and Adam moments (dp=1: its ZeRO partition holds
    each whole), under canonical names."""
    opt = engine.optimizer
    out = {}
    for name, p in engine.module.named_parameters():
        m = p._hp_mapping
        assert m is not None and m.lp_fragment_address.numel == p.numel(), name
        flat = opt.single_partition_of_fp32_groups[m.param_group_index]
        adam = opt.optimizer.state[flat]
        h = m.hp_fragment_address
        st = {"fp32": flat.narrow(0, h.start, h.numel)}
        st.update({s: adam[s].narrow(0, h.start, h.numel) for s in STATES[1:]})
        out[canonical(name)] = {s: t.detach().clone().reshape(p.shape) for s, t in st.items()}
    return out


def full_state(engine):
    """Every stage's local_state merged. The tied module lives whole on both stages: its tied
    attribute (the word embedding) is kept in sync, so both copies must agree; its other
    parameters (the position embedding) are dead on the last stage, which only calls the head,
    so they drift there under weight decay, and stage 0's copy is the model's (ucp's gpt rules
    read it from the first stage, as Megatron-DeepSpeed's own converter does)."""
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, local_state(engine))
    full = {}
    for stage_state in everyone:
        for n, st in stage_state.items():
            if n in full:
                if n != "embedding.word_embeddings.weight":
                    continue
                for s in STATES:
                    assert torch.equal(full[n][s].view(torch.int32), st[s].view(torch.int32)), \
                        f"{n}/{s}: the tied copies differ"
            else:
                full[n] = st
    return full


def run_steps(engine, first, last):
    losses = {}
    for step in range(first, last + 1):
        it = iter(batches(step))
        loss = engine.train_batch(data_iter=it)
        # The last stage computes the loss; train_batch broadcasts the mean to every stage.
        losses[step] = float(loss)
    return losses


def _train_rank(rank, world, work):
    engine = make_engine()
    assert engine.num_stages == PP
    layers = [i for i in range(2, LAYERS + 2) if engine.module._local_start <= i < engine.module._local_stop]
    print(f"stage {engine.stage_id}: specs [{engine.module._local_start}, "
          f"{engine.module._local_stop}), transformer layers {[i - 2 for i in layers]}", flush=True)
    losses = run_steps(engine, 1, SAVE_STEP)
    engine.save_checkpoint(os.path.join(work, "ckpt"))
    truth = full_state(engine)
    losses.update(run_steps(engine, SAVE_STEP + 1, LAST_STEP))
    if rank == 0:
        torch.save(truth, os.path.join(work, "truth.pt"))
        with open(os.path.join(work, "losses.json"), "w") as f:
            json.dump({str(k): v for k, v in losses.items()}, f, indent=1)


def cmd_train(a):
    if os.path.exists(a.work):
        shutil.rmtree(a.work)
    os.makedirs(a.work)
    ds_peer.run_ranks(_train_rank, PP, a.work)
    with open(os.path.join(a.work, "losses.json")) as f:
        losses = {int(k): v for k, v in json.load(f).items()}
    tag = os.path.join(a.work, "ckpt", f"global_step{SAVE_STEP}")
    print("trained pp=2 partition_method=uniform: checkpoint", tag, "files",
          " ".join(sorted(f for f in os.listdir(tag) if f.startswith("layer_"))))
    print("losses", " ".join(f"{losses[s]:.6f}" for s in sorted(losses)))
    assert losses[LAST_STEP] < losses[1], "the run did not learn"


def read_ucp(path):
    import h5py
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    out = {}
    for p in manifest["params"]:
        with h5py.File(os.path.join(path, p["file"]), "r") as h:
            out[p["name"]] = {s: torch.from_numpy(h[s][()]) for s in STATES}
    return manifest, out


def cmd_check(a):
    truth = torch.load(os.path.join(a.work, "truth.pt"))
    manifest, got = read_ucp(a.ucp)
    mm = Mismatches()
    if set(got) != set(truth):
        mm.add(f"parameters on one side only: {sorted(set(got) ^ set(truth))}")
    for n in sorted(set(got) & set(truth)):
        for s in STATES:
            mm.tensor(f"{n}/{s}", got[n][s], truth[n][s])
    mm.check(f"ucp extract of the uneven pipeline checkpoint (source layout "
             f"{manifest['source']['layout']}) == the engine's state, {len(truth)} parameters x "
             f"{len(STATES)} states bitwise")


def _resume_rank(rank, world, work, load):
    engine = make_engine()
    engine.load_checkpoint(load)
    state = full_state(engine)
    losses = run_steps(engine, SAVE_STEP + 1, LAST_STEP)
    if rank == 0:
        torch.save({"state": state, "losses": losses}, os.path.join(work, "resumed.pt"))


def cmd_resume(a):
    ds_peer.run_ranks(_resume_rank, PP, a.work, a.load)
    got = torch.load(os.path.join(a.work, "resumed.pt"))
    truth = torch.load(os.path.join(a.work, "truth.pt"))
    with open(os.path.join(a.work, "losses.json")) as f:
        want = {int(k): v for k, v in json.load(f).items()}
    mm = Mismatches()
    for n in sorted(truth):
        for s in STATES:
            mm.tensor(f"loaded {n}/{s}", got["state"].get(n, {}).get(s), truth[n][s])
    for step, loss in got["losses"].items():
        # The same stages, dp and state: the same bits, so the same loss exactly.
        if loss != want[step]:
            mm.add(f"step {step}: loss {loss!r} after loading, {want[step]!r} in the run")
    mm.check(f"the engine (partition_method=uniform, pp=2) loads {a.load}: state bitwise, "
             f"losses of steps {SAVE_STEP + 1}..{LAST_STEP} equal: "
             + " ".join(f"{got['losses'][s]:.6f}" for s in sorted(got["losses"])))


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--work", required=True)
    c = sub.add_parser("check")
    c.add_argument("--work", required=True)
    c.add_argument("--ucp", required=True)
    r = sub.add_parser("resume")
    r.add_argument("--work", required=True)
    r.add_argument("--load", required=True)
    a = p.parse_args()
    {"train": cmd_train, "check": cmd_check, "resume": cmd_resume}[a.cmd](a)


if __name__ == "__main__":
    main()
