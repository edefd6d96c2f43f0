"""The tree scores' temperature: tokens a round of the demo pair's tree route at several
temperatures of the drafter's distribution, on held-out prompts (the GSM8K *training* questions
the shipped drafter's data left out — `specla data responses` samples 7,373 of the 7,473 with
seed 0 — which no evaluation suite holds either), greedy, 128 new tokens, with the 8-token
chain beside them.

A tree keeps the budget's best nodes by q(v), the drafter's cumulative log-probability. The
temperature only changes that ranking (the beams' tokens stay the top-k): below 1 it ranks the
likeliest continuation's deeper nodes above unlikely siblings. Tokens a round do not depend on
the device; this runs wherever the model does (CPU: fp32).

    python benchmarks/diagnostics/tree_temperature.py [--temperatures 0.25,0.5,1,2] [--n-prompts 30] [--out FILE]
        [--shapes 8x16,8x24,10x16]     # trees of depth x node budget (default 8x16, the e2e route's)
        [--chains 8,10]                # chain lengths (default 8, the e2e route's)
"""

from __future__ import annotations

import argparse
import json

import specla.api as api
from specla.bench.common import environment
from specla.data.suites import load_gsm8k_train
from specla.train.drafter import held_out_gsm8k



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--temperatures", default="0.25,0.35,0.5,0.7,1,2")
    ap.add_argument("--n-prompts", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--shapes", default="8x16", help="trees as DEPTHxBUDGET, comma-separated")
    ap.add_argument("--chains", default="8", help="chain lengths beside the trees, comma-separated")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    lm = api.load(device=a.device, dtype=a.dtype)
    questions = load_gsm8k_train()
    picked = held_out_gsm8k()[:a.n_prompts]
    prompts = [[{"role": "user", "content": questions[i]["question"]}] for i in picked]
    runs = [(f"chain{n}" if n != "8" else "chain", dict(route="chain", chain_length=int(n)))
            for n in a.chains.split(",")]
    shapes = [tuple(int(x) for x in sh.split("x")) for sh in a.shapes.split(",")]
    runs += [(f"tree d{d} n{n} T={t}", dict(route="tree", tree_topk=4, tree_depth=d, tree_budget=n,
                                             tree_temperature=float(t)))
             for d, n in shapes for t in a.temperatures.split(",")]
    rows = []
    for name, kw in runs:
        tokens = rounds = 0
        for p in prompts:
            g = lm.generate(p, max_new_tokens=a.max_new_tokens, **kw)
            tokens, rounds = tokens + len(g.tokens), rounds + g.rounds
        rows.append({"run": name, **kw, "prompts": len(prompts), "tokens_per_round": tokens / rounds})
        print(json.dumps(rows[-1]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**environment(), "prompts": f"GSM8K train questions left out of the drafter's data: {picked}",
                       "dtype": str(lm.model.dtype).replace("torch.", ""), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
