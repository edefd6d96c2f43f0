"""A/B (untracked): the path verifier of 98719e0 against the current one, realistic pending sizes."""
import argparse, json, sys, os
import torch, triton
sys.path.insert(0, os.path.dirname(__file__))
import old_serial, old_closure
from specla import ops
from specla.bench.common import environment, graph_time_ms
from specla.bench.kernels import Bench
from specla.ops import counters
from specla.ops.gdn import paths, serial

TREE = [-1, 0, 0, 1, 1, 2, 3, 3, 6, 6, 8, 8, 10, 12, 12, 13, 13]
CHAIN9 = list(range(-1, 8))


def old_paths(q, k, v, g, beta, state, parents, scale, pending=None, valid=None, *, block_v=16, num_warps=4):
    B, n, HV, V = v.shape
    BV = serial.block_size(V, block_v)
    tiles = B * HV * triton.cdiv(V, BV)
    ticket = counters.zeroed(state.device, tiles)
    table, length, leaves = old_closure.path_tables(parents, valid)
    return old_serial.launch(q, k, v, g, beta, state, parents, scale, pending, grid=(tiles, n), tree=True,
                             paths=(table, length, leaves, ticket), valid=valid, block_v=BV, num_warps=num_warps)


def main():
    ap = argparse.ArgumentParser(); ap.add_argument("--out"); a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    b = Bench(dev, 4, 4, 64, 64, 12, torch.bfloat16, False) if cuda else Bench(dev, 2, 2, 16, 16, 2, torch.float32, True)
    tiling = dict(ops.TILING) if cuda else {"block_v": 8, "num_warps": 1}
    res = {}
    for tname, topo, real in (("chain9", CHAIN9, 9), ("tree", TREE, 17), ("tree_pad14", TREE, 14)):
        n = len(topo)
        par = torch.tensor([topo], device=dev)
        valid = torch.tensor([real], device=dev)
        layers = b.layer_inputs(n, seed=n)
        for P in (9, 17):
            pend = b.pending(P=P, A=5, seed=1)
            fns = {"chain": lambda *x: serial.gdn_tree_verify(*x, chain=True, **tiling)} if tname == "chain9" else {}
            fns |= {"new": lambda *x: paths.gdn_tree_verify(*x, **tiling), "old": lambda *x: old_paths(*x, **tiling)}
            if tname != "chain9":
                # same bits first
                q, k, v, g, beta, S = layers[0]
                S1, S2 = S.clone(), S.clone()
                o1, u1 = paths.gdn_tree_verify(q, k, v, g, beta, S1, par, 0.125, pend, valid, **tiling)
                o2, u2 = old_paths(q, k, v, g, beta, S2, par, 0.125, pend, valid, **tiling)
                assert torch.equal(o1, o2) and torch.equal(u1, u2) and torch.equal(S1, S2)
            for fname, fn in fns.items():
                def go(fn=fn, pend=pend, par=par, valid=valid, layers=layers):
                    for q, k, v, g, beta, S in layers:
                        fn(q, k, v, g, beta, S, par, 0.125, pend, valid)
                for rep in range(2):
                    res[f"{tname}_P{P}_{fname}_{rep}"] = graph_time_ms(go, cuda) * 1e3 / b.layers
    print(" ".join(f"{k} {v:.2f}" for k, v in res.items()))
    if a.out:
        json.dump({**environment(), "us_per_layer": res}, open(a.out, "w"), indent=1)


main()
