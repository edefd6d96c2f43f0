"""Programmatic dependent launch (`ops.pdl`) changes when kernels start, never what they compute:
the decode loop's graphed AR steps and rounds must emit the same reports, bit for bit, with it
on and off. A kernel that read its predecessor's output before waiting would show up here as a
difference (or as a flaky one: run it a few times).

Per setting (SPECLA_PDL=0, then 1), on a fresh random model of the shape (same seed), after the
same 256-token prompt: `--steps` graphed AR steps, then `--rounds` graphed rounds (delayed
commit) on a 12-draft chain and on Table 1's top-4 depth-4 tree of 16 drafts. The drafts follow
the AR steps' greedy tokens (along the chain; along the tree's first-child path, the other nodes
random), so rounds accept several drafts and the next verify applies a pending update of as
many factors; where a round's output leaves the AR tokens (a near-tie rounded the other way, or
the AR tokens run out) the drafts are random from then on. The reports (emitted tokens, counts)
are compared between the settings; how many tokens each route emitted is recorded, and how many
of a route's first tokens equal the AR steps'. On random bf16 weights the logits are near-ties
and a 17-row verify's argmax leaves the AR step's at once (H100, 677faf1: 1.01 tokens a round),
so `--dtype float32` is the run that exercises pending updates of several factors.

    SPECLA_COMPILE=1 python benchmarks/diagnostics/pdl_check.py [--shape gdn-1.3b-paper] [--out FILE]
    TRITON_INTERPRET=1 python benchmarks/diagnostics/pdl_check.py --device cpu --shape tiny --steps 24 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from specla.acceptance import REPORT_HEAD
from specla.bench.common import environment
from specla.bench.decode import ar_runner, round_runner
from specla.bench.trees import beam_tree
from specla.ops import pdl
from specla.shapes import random_model
from specla.topology import children

ROUTES = {"chain12": list(range(-1, 12)), "tree16": beam_tree(4, 4, 16)}


def first_child_path(parents: list[int]) -> list[int]:
    """The nodes from the root down its first children (the lowest index at each level)."""
    kids, path = children(torch.tensor(parents)), [0]
    while kids[path[-1]]:
        path.append(kids[path[-1]][0])
    return path


def greedy_drafts(parents: list[int], ar: list[int], vocab: int, seed: int = 0):
    """(propose, consume, state): propose gives the draft nodes' tokens, the AR continuation along
    the first-child path from the tokens emitted so far; consume(report row) moves past a round's
    output and stops following the AR tokens once the output leaves them; state["matched"]
    counts the tokens emitted until then."""
    path = first_child_path(parents)[1:]
    g = torch.Generator().manual_seed(seed)
    state = {"pos": 0, "on": True, "matched": 0}

    def propose():
        toks = torch.randint(0, vocab, (len(parents) - 1,), generator=g)
        pos = state["pos"]
        if state["on"]:
            for i, node in enumerate(path):
                if pos + i < len(ar):
                    toks[node - 1] = ar[pos + i]
        return toks

    def consume(row):
        count = row[0]
        out = row[REPORT_HEAD:REPORT_HEAD + count]
        pos = state["pos"]
        state["on"] = state["on"] and out == ar[pos:pos + count]
        state["pos"] = pos + count
        state["matched"] += count * state["on"]

    return propose, consume, state


def reports(shape: str, device: str, steps: int, rounds: int, dtype: torch.dtype) -> dict:
    dev = torch.device(device)
    model = random_model(shape, device=dev, dtype=dtype)
    prompt = torch.randint(0, model.cfg.vocab_size, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    run = ar_runner(model, prompt, steps)
    ar_reports = [run() for _ in range(steps)]
    ar = [r[0][REPORT_HEAD] for r in ar_reports]
    out = {"pdl": pdl.enabled(dev), "ar": ar_reports}
    for name, parents in ROUTES.items():
        propose, consume, state = greedy_drafts(parents, ar, model.cfg.vocab_size)
        draw, run, _ = round_runner(model, prompt, parents, rounds, propose=propose)
        got = []
        for _ in range(rounds):
            draw()
            got.append(run())
            consume(got[-1][0])
        out[name] = got
        out[name + "_matched"] = state["matched"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="gdn-1.3b-paper")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=1000, help="AR steps (also the drafts' source)")
    ap.add_argument("--rounds", type=int, default=80)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="float32: fewer near-ties between a round's and an AR step's argmax, so drafts that "
                         "follow the AR tokens are accepted on random weights")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    res, before = {}, os.environ.get("SPECLA_PDL")
    try:
        for flag in ("0", "1"):
            os.environ["SPECLA_PDL"] = flag
            res[flag] = reports(a.shape, a.device, a.steps, a.rounds, getattr(torch, a.dtype))
    finally:
        if before is None:
            os.environ.pop("SPECLA_PDL", None)
        else:
            os.environ["SPECLA_PDL"] = before
    off, on = res["0"], res["1"]
    rows = []
    for route in ["ar", *ROUTES]:
        same = sum(x == y for x, y in zip(off[route], on[route]))
        first = next((i for i, (x, y) in enumerate(zip(off[route], on[route])) if x != y), None)
        emitted = sum(x[0][0] for x in on[route])
        matched = on.get(route + "_matched")  # rounds: tokens emitted before the output left AR's
        rows.append({"route": route, "calls": len(on[route]), "identical": same, "first_difference": first,
                     "tokens_emitted": emitted, "tokens_per_call": emitted / len(on[route]),
                     "tokens_equal_to_ar": matched})
        print(f"{route:8s} {same}/{len(on[route])} reports identical with PDL on and off (first difference: "
              f"{first}); {emitted / len(on[route]):.2f} tokens a call"
              f"{'' if matched is None else f', the first {matched} equal to the AR steps'}; PDL on: {on['pdl']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**environment(), "shape": a.shape, "dtype": a.dtype, "note": __doc__.splitlines()[0], "pdl_enabled": on["pdl"],
                       "rows": rows}, f, indent=1)
    identical = all(r["identical"] == r["calls"] for r in rows)
    return 0 if identical and (on["pdl"] or a.device == "cpu") else 1


if __name__ == "__main__":
    raise SystemExit(main())
