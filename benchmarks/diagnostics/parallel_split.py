"""What the parallel verifier costs a layer, split over K into two launches or not.

Until 2026-12-06 the parallel verifier was one launch: a program per (value head, V-tile)
looped over the whole of K, each forming K Kᵀ and Q Kᵀ for itself, with node 0 peeled off
33-node blocks. Now `_products_kernel` forms the K-long products a K stretch a program and
`_solve_kernel` sums them and solves (module docstring). This times, per layer of the paper's
shape (H = HV = 8, dk = dv = 256, fp32 q/k/v as the verify's prelude writes them), each from a
CUDA graph of `--layers` layers (`bench.common.graph_time_ms`), the installed module at each
tiling of `SPLIT_TILINGS` and every given copy of `ops/gdn/parallel.py` (`--variant
NAME=FILE`, at its own default tiling), on a 13-node chain and Table 1's beam trees of 16 and
32 drafts (17 and 33 nodes), with a pending update of 5 accepted factors in a 9-row buffer
(the runtime's) and without one. Every variant's o and u are compared with the reference first
and the relative error recorded; the installed module's must be under 1e-4.

    TRITON_INTERPRET=1 python benchmarks/diagnostics/parallel_split.py     # CPU smoke test (tiny shape)
    python benchmarks/diagnostics/parallel_split.py --variant old=FILE [--out FILE]
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

# nodes -> parents: a chain of 12 drafts and Table 1's (top-k 4, depth 4) trees of 16 and 32 drafts
TOPOLOGIES = {13: list(range(-1, 12)), 17: beam_tree(4, 4, 16, seed=0), 33: beam_tree(4, 4, 32, seed=0)}
# NT -> (BV, KW, BKC, products' warps, solve's warps) timed besides the shipped one
SPLIT_TILINGS = {
    16: [(16, 32, 32, 4, 4), (16, 64, 64, 4, 4), (64, 64, 64, 4, 4)],
    32: [(32, 64, 32, 4, 4), (64, 64, 64, 4, 4), (32, 128, 64, 4, 4), (16, 64, 64, 4, 4), (32, 64, 32, 2, 4),
         (32, 64, 64, 8, 4)],
    64: [(16, 64, 32, 4, 8), (16, 64, 32, 8, 8), (32, 64, 32, 4, 8), (16, 32, 32, 8, 8)],
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", default=[], help="NAME=FILE: a copy of ops/gdn/parallel.py")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--no-sweep", action="store_true", help="time the installed module at its shipped tiling only")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    tmp = Path(tempfile.mkdtemp())
    variants = {name: load_variant(Path(f).read_text(), name, tmp) for name, f in (v.split("=", 1) for v in a.variant)}
    H, HV, K, V = (8, 8, 256, 256) if cuda else (1, 2, 32, 16)
    b = Bench(dev, H, HV, K, V, a.layers if cuda else 1, torch.float32, not cuda)
    rows = []
    for n, p in TOPOLOGIES.items():
        par = torch.tensor([p], device=dev)
        layers = b.layer_inputs(n, seed=n)
        S0 = layers[0][5].clone()  # the timing loops advance the states in place (the pending flush)
        NT = parallel.padded_nodes(n)
        runs = [("current", parallel, {"tiling": t}, t)
                for t in [parallel.TILINGS[NT]] + (SPLIT_TILINGS[NT] if cuda and not a.no_sweep else [])]
        runs += [(name, mod, {}, "default") for name, mod in variants.items()]
        for pname, pend in (("pending5of9", b.pending(9, 5, 1)), ("none", None)):
            q, k, v, g, beta, _ = layers[0]
            ro, ru = naive.gdn_tree_verify(q, k, v, g, beta, S0.clone(), par, K ** -0.5, pend)
            for name, mod, kw, tiling in runs:
                o, u = mod.gdn_tree_verify(q, k, v, g, beta, S0.clone(), par, K ** -0.5, pend, **kw)
                err = max(float((o - ro).abs().max() / ro.abs().max()), float((u - ru).abs().max() / ru.abs().max()))

                def go(mod=mod, kw=kw, pend=pend):
                    for q, k, v, g, beta, S in layers:
                        mod.gdn_tree_verify(q, k, v, g, beta, S, par, K ** -0.5, pend, **kw)
                us = graph_time_ms(go, cuda) * 1e3 / b.layers
                rows.append({"nodes": n, "pending": pname, "variant": name, "tiling": tiling,
                             "us_per_layer": us, "rel_err": err})
                print(f"{n} nodes  {pname:11s} {name:8s} {str(tiling):24s} {us:7.2f} µs a layer"
                      f"{'' if cuda else ' (interpreter: no timing)'}  rel err {err:.1e}")
                # the shipped kernel must be exact to fp32 rounding; a variant may be inexact on
                # purpose (single-pass TF32 as a bound): its error is recorded beside its time
                assert name != "current" or err < 1e-4, f"{tiling}: o/u off the reference by {err:.1e}"
    if a.out and cuda:
        with open(a.out, "w") as f:
            json.dump({**environment(), "layers": a.layers, "shape": {"H": H, "HV": HV, "K": K, "V": V},
                       "tilings": "(BV, KW, BKC, products' warps, solve's warps)",
                       "note": __doc__.splitlines()[0], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
