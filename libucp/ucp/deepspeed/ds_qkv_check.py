#!/usr/bin/python3
"""The fused QKV's row order as the model sees it: PyTorch's forward pass (tests/engine/
torch_ref.py, the reference of ucp's engine) over two universal checkpoints ucp extracted from
one Megatron-DeepSpeed checkpoint, read in the right QKV order and in the wrong one, against the
same pass over the truth the checkpoint was cut from (expected.pt of the fixtures).

    /usr/bin/python3 ds_qkv_check.py RIGHT WRONG EXPECTED_PT

RIGHT must give the truth's loss and logits exactly (the same fp32 weights), WRONG a visibly
different model. Exit status 0 when both hold.
"""

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                "tests", "engine"))
import torch_ref  # noqa: E402


def logits(cfg, params, inputs):
    """The summed loss and the logits (real vocabulary rows) of torch_ref's forward pass on
    `inputs` predicting themselves; the logits are captured where forward_loss hands them to
    cross_entropy, so the pass is torch_ref's own, unchanged."""
    p = {n: torch.tensor(a) for n, a in torch_ref.pad_vocab(cfg, params).items()}
    captured = {}
    real = torch.nn.functional.cross_entropy

    def grab(x, target, reduction="mean"):
        captured["logits"] = x.detach().clone()
        return real(x, target, reduction=reduction)

    torch.nn.functional.cross_entropy = grab
    try:
        loss = torch_ref.forward_loss(p, cfg, inputs, inputs.clone())
    finally:
        torch.nn.functional.cross_entropy = real
    return float(loss), captured["logits"]


def main():
    right_dir, wrong_dir, expected_pt = sys.argv[1:4]
    cfg, right = torch_ref.load_universal(right_dir)
    _, wrong = torch_ref.load_universal(wrong_dir)
    truth = {n: s["fp32"].numpy().astype(np.float32)
             for n, s in torch.load(expected_pt).items()}
    gen = torch.Generator().manual_seed(3)
    inputs = torch.randint(0, cfg["vocab"], (2, 12), generator=gen)
    loss_t, logits_t = logits(cfg, truth, inputs)
    loss_r, logits_r = logits(cfg, right, inputs)
    loss_w, logits_w = logits(cfg, wrong, inputs)
    diff_w = float((logits_w - logits_t).abs().max())
    print(f"loss: truth {loss_t:.9f}, right QKV order {loss_r:.9f}, wrong {loss_w:.9f}; "
          f"max |logit difference| right {float((logits_r - logits_t).abs().max()):.3g}, "
          f"wrong {diff_w:.3g}")
    ok = True
    if not torch.equal(logits_r, logits_t) or loss_r != loss_t:
        print("FAIL: the right QKV order does not give the truth's logits exactly")
        ok = False
    if diff_w < 1e-3:
        print("FAIL: the wrong QKV order does not visibly change the logits")
        ok = False
    if ok:
        print("ok: right order == truth bitwise, wrong order changes the model")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
