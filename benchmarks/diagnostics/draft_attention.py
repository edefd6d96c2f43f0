"""A draft step's attention: PyTorch's SDPA (what the EAGLE drafter called before; cuDNN in bf16) against
`ops.attention.triton.masked_attention` at several tilings, on the demo drafter's heads (4 x 64)
and the 1.3B stand-in's (16 x 128), 1 query (chain) or 4 (beam tree), windows of 128-1024
slots. 20 calls replayed from one CUDA graph, divided by 20; every tiling is checked against the
reference first. Written because the first tiling (256 slots a program, 64-slot blocks)
measured 5.6 µs a call against cuDNN's 6.0 on the demo pair and ~11 µs against 7.2 µs at the
1.3B shape (rounds_ab_41a0cf8.json, controlled_41a0cf8.json): its programs loop.

    python benchmarks/diagnostics/draft_attention.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from specla.bench.common import environment, graph_time_ms
from specla.ops.attention import naive, triton as attn

CALLS = 20
# (split, block, warps): slots a program, slots a step, warps; split == block: one step a program
TILINGS = [(256, 64, 4), (256, 32, 4), (64, 64, 4), (128, 128, 4), (128, 128, 8), (256, 256, 8), (32, 32, 4),
           (64, 32, 4), (128, 64, 4), (128, 64, 8)]
SHAPES = [(4, 64, n, W) for n in (1, 4) for W in (128, 256, 512, 1024)] + [(16, 128, 1, W) for W in (256, 512, 1024)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    shapes = SHAPES if cuda else SHAPES[:1]  # on CPU (interpreter): a smoke test of the script
    calls = CALLS if cuda else 1
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for H, D, n, W in shapes if dtype == torch.bfloat16 else [(4, 64, 1, 256), (4, 64, 4, 256)][:len(shapes)]:
            g = torch.Generator(device=dev).manual_seed(0)
            q = torch.randn(1, n, H, D, device=dev, generator=g).to(dtype)
            cache = torch.randn(2, 1, H, W + 1, D, device=dev, generator=g).to(dtype)
            k, v = cache[0, :, :, :W], cache[1, :, :, :W]
            mask = torch.rand(1, n, W, device=dev, generator=g) < 0.8
            mask[..., 0] = True
            scale = D ** -0.5
            ref = naive.masked_attention(q, k, v, mask, scale).float()

            def sdpa():
                if dtype == torch.float32:  # the drafter's fp32 path: two matmuls and a softmax
                    s = (q.transpose(1, 2) @ k.transpose(-1, -2)).mul(scale).masked_fill(~mask[:, None], float("-inf"))
                    return (torch.softmax(s, -1) @ v).transpose(1, 2).flatten(2)
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale)
                return o.transpose(1, 2).flatten(2)

            row = {"dtype": str(dtype).split(".")[-1], "heads": H, "head_dim": D, "queries": n, "window": W,
                   "sdpa_us": graph_time_ms(lambda: [sdpa() for _ in range(calls)], cuda) * 1e3 / calls,
                   "sdpa_err": float((sdpa().float() - ref).abs().max()), "triton": []}
            for split, block, warps in TILINGS:
                if block > split or block * D > 16384:
                    continue
                out = attn.masked_attention(q, k, v, mask, scale, split=split, block=block, num_warps=warps)
                err = float((out.float() - ref).abs().max())
                us = graph_time_ms(lambda: [attn.masked_attention(q, k, v, mask, scale, split=split, block=block,
                                                                  num_warps=warps) for _ in range(calls)], cuda)
                row["triton"].append({"split": split, "block": block, "warps": warps, "us": us * 1e3 / calls,
                                      "err": err})
            best = min(row["triton"], key=lambda t: t["us"])
            print(f"{row['dtype']:8s} H={H:2d} D={D:3d} n={n} W={W:4d}  sdpa {row['sdpa_us']:6.2f} us  "
                  f"best triton {best['us']:6.2f} us (split {best['split']}, block {best['block']}, "
                  f"warps {best['warps']}, err {best['err']:.1e})  " +
                  " ".join(f"{t['split']}/{t['block']}/{t['warps']}:{t['us']:.2f}" for t in row["triton"]))
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**environment(), "calls_per_graph": calls, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
