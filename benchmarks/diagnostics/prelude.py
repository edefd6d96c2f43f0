"""What a verify's prelude (tree conv, silu, l2 norms, gates: `ops.tree_prelude`) costs a layer.

At the paper's shape (H = HV = 8, dk = dv = 256, conv width 4) the prelude of a 13-node chain
took 11.5 µs a layer in the 1.3B round (`controlled_e405d6b_h100.json`'s profile), as long as
the chain's verify itself. This times, per layer, from a CUDA graph of `--layers` layers, every
given copy of `ops/conv/triton.py` (`--variant NAME=FILE`; the installed module as `current`,
at each of its tilings of (nodes a program, warps)) on chains of 9 and 13 nodes and Table 1's
(4, 4, 16) beam tree (17 nodes), and an AR step's `step_prelude` beside them. Every variant's
outputs must equal the installed module's bit for bit (they are one computation per element);
the check runs before timing.

    TRITON_INTERPRET=1 python benchmarks/diagnostics/prelude.py     # CPU smoke test (tiny shape)
    python benchmarks/diagnostics/prelude.py --variant old=FILE [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from specla.bench.common import environment, graph_time_ms, load_variant
from specla.bench.trees import beam_tree
from specla.ops.conv import triton as conv

TILINGS = [(2, 4), (2, 2), (2, 8), (4, 4), (4, 8), (8, 16), (16, 8)]


def topologies(dev) -> dict[str, torch.Tensor]:
    chain = lambda n: torch.arange(-1, n - 1, device=dev)[None]  # noqa: E731
    return {"chain9": chain(9), "chain13": chain(13),
            "tree17": torch.tensor([beam_tree(4, 4, 16, seed=0)], device=dev)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", default=[], help="NAME=FILE: a copy of ops/conv/triton.py")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    tmp = Path(tempfile.mkdtemp())
    mods = {"current": conv} | {name: load_variant(Path(f).read_text(), name, tmp)
                                for name, f in (v.split("=", 1) for v in a.variant)}
    H, HV, K, V, W = (8, 8, 256, 256, 4) if cuda else (1, 2, 16, 16, 4)
    C, L = 2 * H * K + HV * V, a.layers if cuda else 1
    dt = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dev)  # noqa: E731
    weights = [(rnd(C, W).to(dt), rnd(HV), rnd(HV) * 4) for _ in range(L)]
    states = [rnd(1, C, W - 1).to(dt) for _ in range(L)]
    rows = []

    def record(topo, n, name, tiling, us):
        rows.append({"topology": topo, "nodes": n, "variant": name, "tiling": tiling, "us_per_layer": us})
        print(f"{topo:8s} {n:2d} nodes  {name:8s} tiling {str(tiling):8s} {us:7.2f} µs a layer"
              f"{'' if cuda else ' (interpreter: no timing)'}")

    for topo, par in topologies(dev).items():
        n = par.shape[1]
        xs = [(rnd(1, n, C).to(dt), rnd(1, n, HV).to(dt), rnd(1, n, HV).to(dt)) for _ in range(L)]

        def run(mod, layer, **kw):
            (x, av, bv), (w, A_log, dt_bias) = xs[layer], weights[layer]
            return mod.tree_prelude(x, states[layer], w, None, par, av, bv, A_log, dt_bias, H, K, False, **kw)

        ref = run(conv, 0)
        for name, mod in mods.items():
            for tiling in (TILINGS if cuda else TILINGS[:2]) if mod is conv else [None]:
                kw = {"tiling": tiling} if tiling else {}
                if not all(torch.equal(o, r) for o, r in zip(run(mod, 0, **kw), ref)):
                    raise SystemExit(f"{name} {tiling}: outputs differ from the installed module's on {topo}")
                us = graph_time_ms(lambda mod=mod, kw=kw: [run(mod, i, **kw) for i in range(L)], cuda) * 1e3 / L
                record(topo, n, name, tiling, us)
    step_x = [(rnd(1, 1, C).to(dt), rnd(1, 1, HV).to(dt), rnd(1, 1, HV).to(dt)) for _ in range(L)]

    def step(mod):
        for i in range(L):
            (x, av, bv), (w, A_log, dt_bias) = step_x[i], weights[i]
            mod.step_prelude(x, states[i], w, None, av, bv, A_log, dt_bias, H, K, False)

    for name, mod in mods.items():
        record("step", 1, name, None, graph_time_ms(lambda mod=mod: step(mod), cuda) * 1e3 / L)
    if a.out and cuda:
        with open(a.out, "w") as f:
            json.dump({**environment(), "layers": L, "shape": {"H": H, "HV": HV, "K": K, "V": V, "W": W},
                       "note": __doc__.splitlines()[0], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
