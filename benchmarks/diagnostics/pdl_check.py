"""Programmatic dependent launch (`ops.pdl`) changes when kernels start, never what they compute:
the decode loop's graphed AR steps and rounds must emit the same reports, bit for bit, with it
on and off. A kernel that read its predecessor's output before waiting would show up here as a
difference (or as a flaky one: run it a few times).

Per setting (SPECLA_PDL=0, then 1), on a fresh random model of the shape (same seed): 64 graphed
AR steps, then 100 graphed rounds on a 12-draft chain and 100 on Table 1's top-4 depth-4 tree of
16 drafts (random drafts from a seeded generator, delayed commit), each route after the same
256-token prompt; the reports (emitted tokens, counts) are compared.

    SPECLA_COMPILE=1 python benchmarks/diagnostics/pdl_check.py [--shape gdn-1.3b-paper] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from specla.bench.common import environment
from specla.bench.decode import ar_runner, round_runner
from specla.bench.trees import beam_tree
from specla.ops import pdl
from specla.shapes import random_model

ROUTES = {"chain12": list(range(-1, 12)), "tree16": beam_tree(4, 4, 16)}


def reports(shape: str, steps: int, rounds: int) -> dict:
    dev = torch.device("cuda")
    model = random_model(shape, device=dev)
    prompt = torch.randint(0, model.cfg.vocab_size, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    run = ar_runner(model, prompt, steps)
    out = {"pdl": pdl.enabled(dev), "ar": [run() for _ in range(steps)]}
    for name, parents in ROUTES.items():
        draw, run = round_runner(model, prompt, parents, rounds)
        got = []
        for _ in range(rounds):
            draw()
            got.append(run())
        out[name] = got
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="gdn-1.3b-paper")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    res = {}
    for flag in ("0", "1"):
        os.environ["SPECLA_PDL"] = flag
        res[flag] = reports(a.shape, a.steps, a.rounds)
    off, on = res["0"], res["1"]
    rows = []
    for route in ["ar", *ROUTES]:
        same = sum(x == y for x, y in zip(off[route], on[route]))
        first = next((i for i, (x, y) in enumerate(zip(off[route], on[route])) if x != y), None)
        rows.append({"route": route, "calls": len(on[route]), "identical": same, "first_difference": first,
                     "tokens_emitted": sum(x[0][0] for x in on[route])})
        print(f"{route:8s} {same}/{len(on[route])} reports identical with PDL on and off"
              f" (first difference: {first}); PDL on: {on['pdl']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**environment(), "shape": a.shape, "note": __doc__.splitlines()[0], "pdl_enabled": on["pdl"],
                       "rows": rows}, f, indent=1)
    return 0 if all(r["identical"] == r["calls"] for r in rows) and on["pdl"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
