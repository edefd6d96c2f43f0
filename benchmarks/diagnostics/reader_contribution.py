"""What ReaDy's state reader contributes, offline (CPU is enough at the demo size).

`bench ready` finds ReaDy level with the DSpark drafter it was adapted from and with the
fine-tuned control. This scores the shipped drafters on the held-out responses exactly as
training validates them (`train.block_drafter.evaluate`: per-position top-1, survival of full
blocks, accepted length), and ReaDy twice more: with its reader's output zeroed (the same
weights, no state access) and with the reader fed another sequence's states (the batch rolled
by one sequence). It also records the reader's residual norm against the stream it is added to.
If zeroing or misrouting the reads moves nothing, the drafter does not use them.

    python benchmarks/diagnostics/reader_contribution.py --data .run/responses.npz [--batches 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy

import torch

from specla.api import DEMO_DIR
from specla.bench.common import environment, write_json
from specla.drafters.blocks import load_block_drafter
from specla.train import block_drafter as bd
from specla.train.drafter import ResponseBatches, ResponseSet, frozen_target


class OtherSequenceStates(bd.BlockLoss):
    """The validation loss with every block reading the states of the same anchor slot in the
    previous sequence of the batch (states come flattened [B * A, ...])."""

    def forward(self, hidden, emb, logp, tokens, valid, anchors, live, lm_head_weight, states=None):
        states = [s.roll(anchors.shape[1], 0) for s in states]
        return super().forward(hidden, emb, logp, tokens, valid, anchors, live, lm_head_weight, states)


def reader_zeroed(model):
    """A copy of a ReaDy model with its readers' output zeroed: exactly its DSpark backbone."""
    zeroed = copy.deepcopy(model)
    with torch.no_grad():
        for r in zeroed.readers.values():
            r.out.weight.zero_()
    return zeroed


def held_out(data: str, batch_size: int, seq_len: int) -> ResponseBatches:
    """The block trainer's validation batches (its default val_fraction and seed)."""
    responses = ResponseSet(data)
    _, val_idx = responses.split(0.02, 0)
    return ResponseBatches(responses, val_idx, batch_size, seq_len)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="the drafters' training responses (.npz)")
    ap.add_argument("--batches", type=int, default=4, help="held-out batches of 32 sequences")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    dev = torch.device(a.device)
    target = frozen_target(DEMO_DIR, dev)
    val = held_out(a.data, 32, 768)
    n = min(a.batches, len(val))

    ready = load_block_drafter(DEMO_DIR / "ready", target).float()
    zeroed = reader_zeroed(ready)
    ratios = []

    def hook(module, args, out):
        x = args[0]
        ratios.append((out.float().norm(dim=-1) / x.float().norm(dim=-1).clamp(min=1e-12)).mean().item())

    rows = {}
    for name, model in (("dspark", load_block_drafter(DEMO_DIR / "dspark", target).float()),
                        ("dspark-ft", load_block_drafter(DEMO_DIR / "dspark-ft", target).float()),
                        ("ready", ready), ("ready, reader zeroed", zeroed), ("ready, states of another sequence", ready)):
        model.eval()
        handles = [r.register_forward_hook(hook) for r in model.readers.values()] if name == "ready" else []
        loss = OtherSequenceStates if name.endswith("another sequence") else bd.BlockLoss
        try:
            rows[name] = bd.evaluate(loss(model), target, val, n, 16, 0)
        finally:
            for h in handles:
                h.remove()
        print(f"{name:30s} accepted length {rows[name]['val_accept_length']:.4f}  top-1 {rows[name]['val_top1']}")
    ratio = sum(ratios) / len(ratios)
    print(f"reader residual / stream norm at the injection site: {ratio:.4f} (mean over blocks)")
    if a.out:
        write_json(a.out, {**environment(), "held_out_sequences": n * 32, "rows": rows,
                           "reader_residual_over_stream": ratio})


if __name__ == "__main__":
    main()
