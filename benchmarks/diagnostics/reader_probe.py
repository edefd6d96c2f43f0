"""Can a state reader help the demo's DSpark drafter at all? Stage 1 alone, as a probe (CPU).

`reader_contribution.py` finds the shipped ReaDy ignoring its reads after its two-stage
adaptation. This asks the question without the second stage in the way: a reader is trained
on the frozen shipped DSpark drafter (ReaDy stage 1; only the 26 k reader parameters move,
so whatever the held-out loss gains is what the committed states add), at a learning rate of
one's choosing (the paper's 1e-4 by default), then scored on held-out responses as training
validates them against the same drafter with its reader's output zeroed (exactly the frozen
DSpark) and with every block reading another sequence's states.

    python benchmarks/diagnostics/reader_probe.py --data .run/responses.npz [--steps 500]
        [--lr 1e-3] [--batch-size 8] [--seq-len 320] [--out FILE]
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from specla.api import DEMO_DIR
from specla.bench.common import environment, write_json
from specla.drafters.blocks import load_block_drafter
from specla.train import block_drafter as bd
from specla.train.drafter import frozen_target

from reader_contribution import OtherSequenceStates, held_out, reader_zeroed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="the drafters' training responses (.npz)")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=320)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--source-layers", default=None, help="comma-separated target GDN layers (default 6,11)")
    ap.add_argument("--reader-rank", default=None, help="8 (default) or 'full'")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    with tempfile.TemporaryDirectory() as run:
        summary = bd.train_block_drafter(
            DEMO_DIR, run, a.data, kind="ready", stage=1, init_from=DEMO_DIR / "dspark", total_steps=a.steps,
            max_minutes=10**6, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr, eval_every=10**9,
            eval_batches=1, source_layers=[int(x) for x in a.source_layers.split(",")] if a.source_layers else None,
            reader_rank=a.reader_rank, device=a.device)
        target = frozen_target(DEMO_DIR, torch.device(a.device))
        trained = load_block_drafter(f"{run}/export", target).float()
    zeroed = reader_zeroed(trained)
    val = held_out(a.data, a.batch_size, a.seq_len)
    n = min(a.eval_batches, len(val))
    rows = {}
    for name, model, loss in (("reader zeroed (the frozen DSpark)", zeroed, bd.BlockLoss),
                              ("reader trained", trained, bd.BlockLoss),
                              ("reader trained, states of another sequence", trained, OtherSequenceStates)):
        model.eval()
        rows[name] = bd.evaluate(loss(model), target, val, n, 16, 0)
        print(f"{name:45s} loss {rows[name]['val_loss']:.4f}  accepted length {rows[name]['val_accept_length']:.4f}",
              flush=True)
    if a.out:
        write_json(a.out, {**environment(), "steps": a.steps, "lr": a.lr, "batch_size": a.batch_size,
                           "seq_len": a.seq_len, "held_out_sequences": n * a.batch_size,
                           "source_layers": trained.cfg.source_layers, "reader_rank": trained.cfg.reader_rank,
                           "train_seconds": summary["train_seconds"], "rows": rows})


if __name__ == "__main__":
    main()
