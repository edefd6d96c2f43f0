"""The drafter step's fused matmuls (`ops.fused_linear`) against what they replace, per shape:
the demo drafter's five (norm + qkv, o_proj + residual, norm + gate|up + SwiGLU gate, down +
residual, norm + LM head) at 1 row (a chain's draft step) and 4 (a tree depth's beams), bf16.
"modules" is the unfused composition as the drafter's compiled step runs it (Inductor's norm,
gate and add kernels around cuBLAS); the fused kernel runs at every (outputs a program, warps)
tiling. Each variant 20 times in one CUDA graph: µs a call, launch gaps included.

    python benchmarks/diagnostics/fused_linear.py [--out FILE]     # the PNG beside the JSON
    python benchmarks/diagnostics/fused_linear.py --replot FILE.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from specla.bench.common import environment, graph_time_ms
from specla.ops.linear import triton as linear_triton

D, I, V = 256, 768, 8192
SHAPES = {  # name -> (weight rows, K, norm, glu, residual)
    "norm+qkv": (768, D, True, False, False),
    "o_proj+res": (D, D, False, False, True),
    "norm+gate|up+glu": (2 * I, D, True, True, False),
    "down+res": (D, I, False, False, True),
    "norm+lm_head": (V, D, True, False, False),
}
CALLS = 20


def modules(x, w, nw, res, glu):
    if nw is not None:
        xf = x.float()
        x = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6) * nw.float()).to(x.dtype)
    y = F.linear(x, w)
    if glu:
        g, u = y.chunk(2, -1)
        y = F.silu(g) * u
    return y if res is None else res + y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--out", default=None)
    ap.add_argument("--replot", default=None, help="draw the PNG of an earlier run's JSON and stop")
    a = ap.parse_args()
    if a.replot:
        return plot(json.load(open(a.replot))["rows"], a.replot.removesuffix(".json") + ".png")
    torch.set_grad_enabled(False)
    dev, dt = "cuda", torch.bfloat16
    torch._dynamo.config.cache_size_limit = 64  # a compile per shape, none of them dynamic
    compiled = torch.compile(modules, dynamic=False)
    out = []
    for M in (int(m) for m in a.rows.split(",")):
        for name, (N, K, norm, glu, has_res) in SHAPES.items():
            x = torch.randn(1, M, K, device=dev, dtype=dt)
            w = torch.randn(N, K, device=dev, dtype=dt) / K ** 0.5
            nw = torch.ones(K, device=dev, dtype=dt) if norm else None
            res = torch.randn(1, M, N // 2 if glu else N, device=dev, dtype=dt) if has_res else None
            variants = {"modules": lambda: compiled(x, w, nw, res, glu)}
            for bn in (1, 2, 4, 8, 16, 32):
                for warps in (1, 2, 4):
                    BM, BN, BK, _ = linear_triton.fused_tiling(M, N, K, glu, bn)
                    if BM * BN * BK > 8192 * warps // 4 or BN * 32 > 4 * (N // 2 if glu else N):
                        continue  # spills, or too few programs to matter
                    variants[f"fused BN={bn} w={warps}"] = (
                        lambda bn=bn, warps=warps: linear_triton.fused(x, w, nw, 1e-6, res, glu, block_n=bn,
                                                                       num_warps=warps))
            default = linear_triton.fused_tiling(M, N, K, glu)
            for v, fn in variants.items():
                fn()  # compile outside the graph
                us = 1e3 * graph_time_ms(lambda fn=fn: [fn() for _ in range(CALLS)], True) / CALLS
                out.append({"shape": name, "M": M, "N": N, "K": K, "variant": v, "us": us,
                            "default": v == f"fused BN={default[1]} w={default[3]}"})
            rows = [r for r in out if r["shape"] == name and r["M"] == M]
            best = min((r for r in rows if r["variant"] != "modules"), key=lambda r: r["us"])
            ref = next(r for r in rows if r["variant"] == "modules")
            dflt = next((r for r in rows if r["default"]), None)
            print(f"{name:18s} M={M}  modules {ref['us']:6.2f} µs   fused best {best['us']:6.2f} ({best['variant']})"
                  f"   default {dflt['us'] if dflt else float('nan'):6.2f}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**environment(), "calls_per_graph": CALLS, "rows": out}, f, indent=1)
        plot(out, a.out.removesuffix(".json") + ".png")


def plot(rows: list[dict], path: str) -> None:
    """µs a call per shape and row count: the modules, the fused kernel at the tiling
    `fused_tiling` picks now, and its best tiling of the sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["shape"], r["M"]) for r in rows))
    series = {"modules (norm, cuBLAS, gate, add)": [], "fused, current tiling": [], "fused, best tiling": []}
    for name, M in cases:
        rs = [r for r in rows if (r["shape"], r["M"]) == (name, M)]
        N, K, _, glu, _ = (rs[0]["N"], rs[0]["K"], *SHAPES[name][2:])
        _, bn, _, warps = linear_triton.fused_tiling(M, N // 2 if glu else N, K, glu)
        pick = {r["variant"]: r["us"] for r in rs}
        series["modules (norm, cuBLAS, gate, add)"].append(pick["modules"])
        series["fused, current tiling"].append(pick.get(f"fused BN={bn} w={warps}", float("nan")))
        series["fused, best tiling"].append(min(v for k, v in pick.items() if k != "modules"))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.27
    for i, (label, ys) in enumerate(series.items()):
        ax.bar([c + (i - 1) * width for c in range(len(cases))], ys, width, label=label)
    ax.set_xticks(range(len(cases)), [f"{n}\n{M} row{'s' if M > 1 else ''}" for n, M in cases], fontsize=7)
    ax.set_ylabel("µs a call (20 a CUDA graph)")
    ax.set_title("The demo drafter's step matmuls, bf16, H200")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
