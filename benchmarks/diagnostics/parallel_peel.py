"""What peeling node 0 off the parallel verifier's block costs and saves (docs/kernels.md).

A draft tree of 16 drafts is 17 nodes: unpeeled the parallel verifier pads it to a 32-row
block (and 33 nodes to 64); with node 0 peeled off, 16 and 32 rows, node 0's products with
the state and the other nodes then summed beside the block's matmuls. This
times, per layer of the paper's shape (H = HV = 8, dk = dv = 256), each from a CUDA graph of
`--layers` layers (`bench.common.graph_time_ms`), every given copy of `ops/gdn/parallel.py`
(`--variant NAME=FILE`; the installed module as `current`) at each of its tilings, on
Table 1's beam trees of 16 and 32 drafts (17 and 33 nodes), with a pending update of 5 accepted
factors in a 9-row buffer (the runtime's) and without one. Outputs are checked against the
reference before timing.

    TRITON_INTERPRET=1 python benchmarks/diagnostics/parallel_peel.py     # CPU smoke test (tiny shape)
    python benchmarks/diagnostics/parallel_peel.py --variant old=FILE [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from specla.bench.common import environment, graph_time_ms, load_variant
from specla.bench.kernels import Bench
from specla.bench.trees import beam_tree
from specla.ops.gdn import naive, parallel

TREES = {17: (4, 4, 16), 33: (4, 4, 32)}  # nodes -> (top-k, depth, drafts), Table 1's shapes
# (BV, BKC, warps) timed at each padded size, the shipped tiling first
TILINGS = {16: [(16, 32, 4), (16, 16, 4), (32, 32, 4), (32, 32, 8)],
           32: [(16, 32, 4), (16, 16, 4), (16, 16, 8)],
           64: [(16, 16, 8)]}


def check(mod, b: Bench, par, layers, pend) -> float:
    """Largest relative error of o against the reference on the first layer."""
    q, k, v, g, beta, S = layers[0]
    ro, _ = naive.gdn_tree_verify(q.float(), k.float(), v.float(), g, beta, S.clone(), par, b.K ** -0.5, pend)
    o, _ = mod.gdn_tree_verify(q, k, v, g, beta, S.clone(), par, b.K ** -0.5, pend)
    return float((o - ro).abs().max() / ro.abs().max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", default=[], help="NAME=FILE: a copy of ops/gdn/parallel.py")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    tmp = Path(tempfile.mkdtemp())
    mods = {"current": parallel} | {name: load_variant(Path(f).read_text(), name, tmp)
                                    for name, f in (v.split("=", 1) for v in a.variant)}
    H, HV, K, V = (8, 8, 256, 256) if cuda else (1, 2, 16, 16)
    b = Bench(dev, H, HV, K, V, a.layers if cuda else 1, torch.bfloat16 if cuda else torch.float32, not cuda)
    rows = []
    for n, (topk, depth, drafts) in TREES.items():
        par = torch.tensor([beam_tree(topk, depth, drafts, seed=0)], device=dev)
        layers = b.layer_inputs(n, seed=n)
        for pname, pend in (("pending5of9", b.pending(9, 5, 1)), ("none", None)):
            for name, mod in mods.items():
                err = check(mod, b, par, layers, pend)
                NT = mod.padded_nodes(n)
                for bv, bk, warps in TILINGS[NT] if cuda else TILINGS[NT][:1]:
                    def go(mod=mod, bv=bv, bk=bk, warps=warps, pend=pend):
                        for q, k, v, g, beta, S in layers:
                            mod.gdn_tree_verify(q, k, v, g, beta, S, par, b.K ** -0.5, pend,
                                                block_v=bv, block_k=bk, num_warps=warps)
                    us = graph_time_ms(go, cuda) * 1e3 / b.layers
                    rows.append({"nodes": n, "pending": pname, "variant": name, "NT": NT, "block_v": bv,
                                 "block_k": bk, "num_warps": warps, "us_per_layer": us, "rel_err": err})
                    print(f"{n} nodes  {pname:11s} {name:8s} NT {NT:2d}  BV {bv:2d} BK {bk:2d} w {warps}  "
                          f"{us:7.2f} µs a layer{'' if cuda else ' (interpreter: no timing)'}  rel err {err:.1e}")
    if a.out and cuda:
        with open(a.out, "w") as f:
            json.dump({**environment(), "layers": a.layers, "shape": {"H": H, "HV": HV, "K": K, "V": V},
                       "note": __doc__.splitlines()[0], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
