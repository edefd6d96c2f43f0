"""One tree-rollout depth's scoring (`ops.head_expand`: the head-chunk launch, then the merge)
at the demo drafter's shape, against what it replaced and what a chain step does instead.

The demo's tree lost to the chain by about its rollout (tree_shapes_db4bd02_h100: a depth's
head chunks 5.0 µs and merge 5.0 µs on the H100, against ~4.9 µs for a chain step's fused head,
argmax and gather). Per beam count (1: the root's depth, 4: the others), bf16, D = 256, V =
8,192, top-4, over the 33 entries of a depth-8 rollout:
- "chain head": `ops.linear.fused` (norm + LM head) of one row, then argmax;
- "modules": the same fused kernel over the beams' rows, then `beam_expand` (chunks + merge);
- "head_expand": at every (vocabulary tokens a program, warps, dot operands) of the sweep,
  the whole depth ("total") and its head-chunk launch alone ("chunks"; the merge is the rest).
Each variant 20 times in one CUDA graph: µs a call, launch gaps included. Every variant's
tokens and beams are checked against the default tiling's (bf16 operands may round a near-tie
the other way: `equal` records it).

    python benchmarks/diagnostics/head_expand.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch

from specla.bench.common import environment, graph_time_ms
from specla.ops.beam import triton as beam_triton
from specla.ops.linear import triton as linear_triton

D, V, K, ENTRIES = 256, 8192, 4, 33
CALLS = 20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", default="32,64,128")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(V, D, device=dev, generator=g) / D ** 0.5).to(dt)
    nw = (1 + 0.1 * torch.randn(D, device=dev, generator=g)).to(dt)
    out = []

    def timed(nb, name, fn, **extra):
        fn()  # compile outside the graph
        us = 1e3 * graph_time_ms(lambda: [fn() for _ in range(CALLS)], True) / CALLS
        out.append({"nb": nb, "variant": name, "us": us, **extra})
        print(f"nb={nb} {name:40s} {us:6.2f} µs" + "".join(f"  {k}={v}" for k, v in extra.items()), flush=True)

    for nb in (1, 4):
        h = torch.randn(1, nb, D, device=dev, dtype=dt, generator=g)
        scores = None if nb == 1 else -torch.rand(1, nb, device=dev, generator=g)
        rows = None if nb == 1 else torch.rand(1, nb, ENTRIES, device=dev, generator=g) < 0.3
        start = 1 if nb == 1 else 5
        zeros = torch.zeros(1, nb, device=dev)
        if nb == 1:
            timed(nb, "chain head (fused + argmax)", lambda: linear_triton.fused(h, w, nw, 1e-6).argmax(-1))
        timed(nb, "modules (fused + beam_expand)",
             lambda: beam_triton.beam_expand(linear_triton.fused(h, w, nw, 1e-6), zeros if scores is None else scores, K))
        want = beam_triton.head_expand(h, w, nw, 1e-6, scores, K, 1.0, rows, start, ENTRIES)
        for block in (int(x) for x in a.blocks.split(",")):
            for warps in (int(x) for x in a.warps.split(",")):
                for fp32 in (True, False):
                    kw = dict(block=block, num_warps=warps, fp32_dot=fp32)
                    got = beam_triton.head_expand(h, w, nw, 1e-6, scores, K, 1.0, rows, start, ENTRIES, **kw)
                    equal = all(torch.equal(x, y) for x, y in zip(got[:1] + got[2:4], want[:1] + want[2:4]))
                    tag = f"block={block} warps={warps} {'fp32' if fp32 else 'bf16'} dot"
                    timed(nb, f"head_expand {tag}", lambda kw=kw: beam_triton.head_expand(
                        h, w, nw, 1e-6, scores, K, 1.0, rows, start, ENTRIES, **kw), part="total", equal=equal, **kw)
                    timed(nb, f"chunks {tag}", lambda kw=kw: beam_triton.head_chunks(h, w, nw, 1e-6, K, 1.0, **kw),
                         part="chunks", **kw)
    for nb in (1, 4):
        tot = [r for r in out if r["nb"] == nb and r.get("part") == "total"]
        best = min(tot, key=lambda r: r["us"])
        print(f"nb={nb}: best {best['variant']} {best['us']:.2f} µs; " + "; ".join(
            f"{r['variant']} {r['us']:.2f}" for r in out if r["nb"] == nb and "part" not in r))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**environment(), "calls_per_graph": CALLS, "default": {
                "block": beam_triton.HEAD_CHUNK, "warps": beam_triton.HEAD_WARPS, "dot": beam_triton.HEAD_DOT},
                "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
