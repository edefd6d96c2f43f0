"""Where the path verifier's time over a chain verify goes (docs/kernels.md, path verifier).

In the demo pair's rounds the path verifier costs ~11.1 µs a layer on a 16-node depth-8 tree
and the chain verify ~7.3 on 9 nodes (`tree_shapes_8faf436_profile.json`), though a path is
never longer than the chain. This times, per layer, in one process, each from a CUDA graph of
`--layers` layers (`bench.common.graph_time_ms`, divided by the layers):

- `chain9`: the serial kernel's chain mode on 9 nodes (the chain route's verify);
- `paths_chain9`: the path verifier on the same 9-node chain (one path: the chain's work in
  PATHS mode; minus chain9 = the mode's own cost);
- `paths_tree`: the path verifier on a 17-node, depth-8 tree of 8 leaves whose longest path
  is 9 nodes (minus paths_chain9 = what the other 7 paths and their programs add);
- `paths_tree_nopend`: the same without a pending update (its counting and write-back);
- `serial_tree`, `parallel_tree`: the other verifiers on that tree;
- `path_tables`: the once-a-round table launch.

Every case runs with a pending update of 5 accepted factors unless named `_nopend`, at the
demo target's shape (H = HV = 4, dk = dv = 64) and with `--paper` also at the paper's (8, 256).
(2026-12-04, 98719e0, demo: chain9 8.88, paths_chain9 11.05, paths_tree 11.29 µs a layer: the
mode's own cost, not the other paths; leaf-ordered tables saved 0.56 on the tree, and since
became the tables' order, with the state tile requested before the walk is known and the
write-back's counter taken without holding the walk back.)

    TRITON_INTERPRET=1 python benchmarks/diagnostics/path_verify.py   # CPU smoke test (tiny shape)
    python benchmarks/diagnostics/path_verify.py [--out FILE]          # H200
"""

from __future__ import annotations

import argparse
import json

import torch

from specla import ops
from specla.bench.common import environment, graph_time_ms
from specla.bench.kernels import Bench
from specla.ops.gdn import parallel, paths, serial

# a depth-8 beam-like tree: a main path 0-1-3-6-8-10-12-13-15 and side leaves at every depth
TREE = [-1, 0, 0, 1, 1, 2, 3, 3, 6, 6, 8, 8, 10, 12, 12, 13, 13]
CHAIN9 = list(range(-1, 8))


def cases(b: Bench, tiling: dict) -> dict:
    """name -> a function running the case over every layer."""
    dev = b.device
    out = {}
    for topo_name, topo in (("chain9", CHAIN9), ("tree", TREE)):
        n = len(topo)
        par = torch.tensor([topo], device=dev)
        valid = torch.tensor([n], device=dev)
        layers = b.layer_inputs(n, seed=n)
        pend = b.pending(P=17, A=5, seed=1)

        def run(fn, layers=layers, par=par, valid=valid, pending=pend):
            def go():
                for q, k, v, g, beta, S in layers:
                    fn(q, k, v, g, beta, S, par, 0.125, pending, valid)
            return go

        if topo_name == "chain9":
            out["chain9"] = run(lambda *a: serial.gdn_tree_verify(*a, chain=True, **tiling))
            out["paths_chain9"] = run(lambda *a: paths.gdn_tree_verify(*a, **tiling))
            out["chain9_nopend"] = run(lambda *a: serial.gdn_tree_verify(*a, chain=True, **tiling), pending=None)
            out["paths_chain9_nopend"] = run(lambda *a: paths.gdn_tree_verify(*a, **tiling), pending=None)
        else:
            out["paths_tree"] = run(lambda *a: paths.gdn_tree_verify(*a, **tiling))
            out["paths_tree_nopend"] = run(lambda *a: paths.gdn_tree_verify(*a, **tiling), pending=None)
            out["serial_tree"] = run(lambda *a: serial.gdn_tree_verify(*a, **tiling))
            out["parallel_tree"] = run(lambda q, k, v, g, beta, S, par, scale, pending, valid:
                                       parallel.gdn_tree_verify(q, k, v, g, beta, S, par, scale, pending, valid))
            out["path_tables"] = lambda par=par, valid=valid: ops.path_tables(par, valid)
    return out


def measure(b: Bench, tiling: dict, names=None) -> dict:
    res = {}
    for name, fn in cases(b, tiling).items():
        if names is not None and name not in names:
            continue
        per = 1 if name == "path_tables" else b.layers
        # the path verifier's plan is cached on the parents tensor and rebuilt by the capture's
        # eager warm-up, so each graph holds its own table launch, once (as a round does)
        res[name] = graph_time_ms(fn, b.cuda) * 1e3 / per
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--paper", action="store_true", help="also the paper's shape (H = HV = 8, 256)")
    ap.add_argument("--tilings", default=None,
                    help="BV,WARPS pairs joined by ':' (e.g. 8,1:16,4:32,4:64,4): time the chain and path "
                         "cases at each tiling too (default: the verify tiling only); a path program per "
                         "64-wide tile is a quarter of the programs of 16-wide ones")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    tiling = dict(ops.TILING)
    shapes = {"demo": (4, 4, 64, 64)} | ({"paper": (8, 8, 256, 256)} if a.paper else {})
    if not cuda:  # the interpreter: a tiny shape, two layers, one eager call each (no timing)
        shapes, a.layers, tiling = {"tiny": (2, 2, 16, 16)}, 2, {"block_v": 8, "num_warps": 1}
    sweep = [dict(zip(("block_v", "num_warps"), map(int, t.split(",")))) for t in a.tilings.split(":")] \
        if a.tilings else []
    rows = []
    for shape, (H, HV, K, V) in shapes.items():
        b = Bench(dev, H, HV, K, V, a.layers, torch.bfloat16 if cuda else torch.float32, not cuda)
        us = measure(b, tiling)
        rows.append({"shape": shape, "H": H, "HV": HV, "K": K, "V": V, "tiling": tiling, "us_per_layer": us})
        if cuda:
            print(f"{shape}: " + ", ".join(f"{k} {v:.2f}" for k, v in us.items()) + " µs a layer")
        else:
            print(f"{shape}: ran {', '.join(us)} (interpreter: no timing)")
        for t in sweep:
            us = measure(b, t, names=("chain9", "paths_chain9", "paths_tree"))
            rows.append({"shape": shape, "H": H, "HV": HV, "K": K, "V": V, "tiling": t, "us_per_layer": us})
            print(f"{shape} at BV {t['block_v']}, {t['num_warps']} warps: " + (
                ", ".join(f"{k} {v:.2f}" for k, v in us.items()) + " µs a layer" if cuda else f"ran {', '.join(us)}"))
    if a.out and cuda:
        with open(a.out, "w") as f:
            json.dump({**environment(), "layers": a.layers, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
