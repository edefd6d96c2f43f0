"""Kernel microbenchmarks at the paper shape (SpecLA §8.3-8.4, DESIGN §6 and §9).

    python -m specla.bench.kernels                     # H200: writes benchmarks/results/kernels.{json,png}
    python -m specla.bench.kernels --device cpu --quick  # smoke test under Triton's interpreter

JSON keys: device, versions, code_commit (git sha: the key `commit` holds Fig 11a's rows, as the
kernels issue names them), date, shape, copy_bandwidth_Bps, correctness, tiling (serial/hybrid
tile sweep) and tiling_used, table1, cost_fit (the serial/hybrid cost model refitted to
table1), commit (token replay vs factor commit), fused, chain, picked, goals, bench_seconds.

`picked` records every choice the run made from its own sweeps: the tiling of Table 1 and the
hybrid, the chain kernel's tiling per T, the tilings of the delayed-update section (verify alone
and fused, each its own best), and the schedule the hybrid's cost model chose per Table 1 tree
("serial" pass or "hld" chains). The chain rows carry every candidate's time in `candidates`.

Shape: HV = H = 8 value/key heads, dk = dv = 256 (2 MiB fp32 state per layer), 24 layers, bf16
activations (q, k, v), fp32 log-decay, beta and state, random inputs, synthetic beam top-k draft
trees (`specla.bench.trees.beam_tree`). Every route is captured in a CUDA graph and timed as
the median of graph replays (`triton.testing.do_bench`, which flushes L2 before each replay).
"One layer" figures replay 24 layer instances (each with its own state and inputs) and divide
by 24, so graph launch cost is amortised as in a model step. On CPU (`--device cpu`) graphs are
skipped, shapes are tiny and timings are meaningless: it only exercises the code paths.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from specla.bench.common import environment, graph_time_ms
from specla.bench.trees import beam_tree, tree_stats
from specla.graphs import capture as capture_graph

TABLE1_SHAPES = [(2, 12, 16), (2, 24, 32), (4, 4, 16), (4, 4, 32), (4, 12, 16), (4, 24, 32)]
# SpecLA Table 1: R2L ms and each route's speedup over R2L (H100, paper's own timing method).
PAPER_TABLE1 = {
    (2, 12, 16): (22.5, 1.31, 0.58, 2.20), (2, 24, 32): (55.0, 1.36, 1.02, 2.55),
    (4, 4, 16): (37.8, 3.73, 1.70, 5.14), (4, 4, 32): (91.2, 4.74, 3.47, 7.11),
    (4, 12, 16): (19.0, 1.19, 0.52, 1.80), (4, 24, 32): (41.0, 1.30, 0.95, 2.19),
}
TILINGS = [(8, 1), (8, 2), (8, 4), (16, 2), (16, 4), (32, 4), (32, 8)]  # (block_v, num_warps) of serial/hybrid
# (block_v, num_warps) of the path-parallel verifier: wider tiles put fewer programs on the GPU
# at the paper's shape (128 tiles a row at BV 16, where the dispatch keeps the parallel verifier);
# its PATHS mode keeps a second copy of the root tile, so BV 32 needs 8 warps to stay unspilled
# and BV 64 spills at any width (`ops.aot_check`, sm_90)
PATHS_TILINGS = [(16, 4), (16, 8), (32, 8)]


def tilings(quick: bool, table=TILINGS) -> list[dict]:
    """The (block_v, num_warps) configurations a sweep times (of `table`; one when quick)."""
    return [{"block_v": bv, "num_warps": nw} for bv, nw in (table if not quick else [(16, 4)])]


def _sweep(ms: dict, prefix: str) -> dict:
    """The timings of one route's tilings, keyed by what follows `prefix`."""
    return {k[len(prefix):]: v for k, v in ms.items() if k.startswith(prefix)}


@dataclass
class Bench:
    device: torch.device
    H: int
    HV: int
    K: int
    V: int
    layers: int
    act: torch.dtype
    quick: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def time_ms(self, fn) -> float:
        """Median ms of `fn` replayed from a CUDA graph (`bench.common.graph_time_ms`)."""
        return graph_time_ms(fn, self.cuda)

    def layer_inputs(self, n: int, seed: int):
        """Per layer: (q, k, v, g, beta, state) with random values of realistic scale."""
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(self.layers):
            q = torch.nn.functional.normalize(torch.randn(1, n, self.H, self.K, generator=g), dim=-1)
            k = torch.nn.functional.normalize(torch.randn(1, n, self.H, self.K, generator=g), dim=-1)
            v = torch.randn(1, n, self.HV, self.V, generator=g)
            gl = -(torch.rand(1, n, self.HV, generator=g) * 0.5 + 0.01)
            beta = torch.sigmoid(torch.randn(1, n, self.HV, generator=g))
            S = torch.randn(1, self.HV, self.K, self.V, generator=g) * 0.1
            dev = self.device
            out.append((q.to(dev, self.act), k.to(dev, self.act), v.to(dev, self.act), gl.to(dev), beta.to(dev),
                        S.to(dev)))
        return out

    def pending(self, P: int, A: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        pk = torch.nn.functional.normalize(torch.randn(1, P, self.H, self.K, generator=g), dim=-1)
        pg = -(torch.rand(1, P, self.HV, generator=g) * 0.5 + 0.01)
        pu = torch.randn(1, P, self.HV, self.V, generator=g) * 0.1
        dev = self.device
        return pk.to(dev), pg.to(dev), pu.to(dev), torch.tensor([A], device=dev)


def _fla_recurrent():
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    return fused_recurrent_gated_delta_rule


def copy_bandwidth(bench: Bench) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = (1 << 28) if bench.cuda else (1 << 20)
    src = torch.empty(n, dtype=torch.float32, device=bench.device)
    dst = torch.empty_like(src)
    ms = bench.time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3)


def tiling_sweep(bench: Bench) -> list[dict]:
    from specla.ops.gdn import hybrid, serial
    from specla.topology import chain

    par_tree = torch.tensor([beam_tree(4, 4, 32 if not bench.quick else 8, seed=0)], device=bench.device)
    tree_in = bench.layer_inputs(par_tree.shape[1], 1)
    T = 16 if not bench.quick else 4
    par_chain = chain(T, device=bench.device)
    chain_in = bench.layer_inputs(T, 2)
    scale = bench.K ** -0.5
    rows = []
    for opt in tilings(bench.quick):
        hy = bench.time_ms(lambda: [hybrid.gdn_tree_verify(*x, par_tree, scale, **opt) for x in tree_in])
        ch = bench.time_ms(lambda: [serial.gdn_tree_verify(*x, par_chain, scale, chain=True, **opt) for x in chain_in])
        rows.append({**opt, "hybrid_4_4_32_ms": hy, "chain_T16_layer_ms": ch / bench.layers})
    return rows


def pick_tiling(rows: list[dict]) -> dict:
    """The tiling with the smallest sum of hybrid and chain times, each relative to its best."""
    hb = min(r["hybrid_4_4_32_ms"] for r in rows)
    cb = min(r["chain_T16_layer_ms"] for r in rows)
    best = min(rows, key=lambda r: r["hybrid_4_4_32_ms"] / hb + r["chain_T16_layer_ms"] / cb)
    return {"block_v": best["block_v"], "num_warps": best["num_warps"]}


def table1(bench: Bench, tiling: dict) -> list[dict]:
    from specla.ops.gdn import hybrid, parallel, paths, schedule, serial
    from specla.topology import chain, root_to_leaf_paths

    scale = bench.K ** -0.5
    shapes = TABLE1_SHAPES if not bench.quick else [(4, 4, 8)]
    seeds = (0, 1) if not bench.quick else (0,)
    rows = []
    for topk, depth, nodes in shapes:
        per = {"r2l": [], "serial": [], "parallel": [], "hybrid": [], "hybrid_auto": []}
        stats, schedules = [], []
        for seed in seeds:
            p = beam_tree(topk, depth, nodes, seed=seed)
            restores, visits, _ = schedule.cost_terms(torch.tensor([p]))
            stats.append({**tree_stats(p), "restores": float(restores[0]), "visits": float(visits.max()),
                          "chains": int(schedule.hld_schedule(torch.tensor([p])).count)})
            par = torch.tensor([p], device=bench.device)
            ins = bench.layer_inputs(len(p), 100 + seed)
            leaf_paths = root_to_leaf_paths(torch.tensor(p))
            # R2L: the serial verifier once per root-to-leaf path, on pre-gathered path inputs
            r2l_in = [[tuple(t[:, path] for t in x[:5]) + (x[5],) for path in leaf_paths] for x in ins]
            r2l_par = {len(path): chain(len(path), device=bench.device) for path in leaf_paths}
            per["r2l"].append(bench.time_ms(lambda: [serial.gdn_tree_verify(*pi, r2l_par[pi[0].shape[1]], scale,
                                                                            chain=True, **tiling)
                                                     for li in r2l_in for pi in li]))
            per["serial"].append(bench.time_ms(lambda: [serial.gdn_tree_verify(*x, par, scale, **tiling) for x in ins]))
            per["parallel"].append(bench.time_ms(lambda: [parallel.gdn_tree_verify(*x, par, scale) for x in ins]))
            for nt, t in parallel.SWEEP:  # other tilings of the same block
                if nt == parallel.padded_nodes(len(p)):
                    per.setdefault("parallel_" + "_".join(map(str, t)), []).append(bench.time_ms(
                        lambda: [parallel.gdn_tree_verify(*x, par, scale, tiling=t) for x in ins]))
            per["hybrid"].append(bench.time_ms(lambda: [hybrid.gdn_tree_verify(*x, par, scale, **tiling) for x in ins]))
            for t in tilings(bench.quick, PATHS_TILINGS):
                per.setdefault(f"paths_bv{t['block_v']}_w{t['num_warps']}", []).append(bench.time_ms(
                    lambda: [paths.gdn_tree_verify(*x, par, scale, **t) for x in ins]))
            # what dispatch runs inside a graph: the hybrid launch, rows the cost model sends to
            # serial running as one serial pass
            per["hybrid_auto"].append(bench.time_ms(lambda: [hybrid.gdn_tree_verify(*x, par, scale, schedule="auto",
                                                                                    **tiling) for x in ins]))
            schedules.append("serial" if bool(schedule.prefer_serial(par.cpu()).all()) else "hld")
        ms = {k: statistics.mean(v) for k, v in per.items()}
        paths_sweep = _sweep(ms, "paths_")
        paths_tiling = min(paths_sweep, key=paths_sweep.get)
        paper = PAPER_TABLE1.get((topk, depth, nodes))
        rows.append({
            "topk": topk, "depth": depth, "nodes": nodes, "trees": len(seeds),
            "leaves": statistics.mean(s["leaves"] for s in stats), "tree_depth": statistics.mean(s["depth"] for s in stats),
            "serial_restores": statistics.mean(s["restores"] for s in stats),  # a layer, schedule.serial_order
            # the hybrid's chains and the visits on its longest root-to-node path (schedule._terms)
            "hybrid_chains": statistics.mean(s["chains"] for s in stats),
            "hybrid_path_visits": statistics.mean(s["visits"] for s in stats),
            "r2l_ms": ms["r2l"], "serial_ms": ms["serial"], "parallel_ms": ms["parallel"], "hybrid_ms": ms["hybrid"],
            "serial_x": ms["r2l"] / ms["serial"], "parallel_x": ms["r2l"] / ms["parallel"],
            "hybrid_x": ms["r2l"] / ms["hybrid"], "hybrid_over_serial_x": ms["serial"] / ms["hybrid"],
            "hybrid_auto_ms": ms["hybrid_auto"], "hybrid_auto_x": ms["r2l"] / ms["hybrid_auto"],
            "hybrid_auto_over_serial_x": ms["serial"] / ms["hybrid_auto"], "hybrid_schedule": schedules,
            "parallel_sweep_ms": _sweep(ms, "parallel_"),
            # the path-parallel verifier (a program per root-to-leaf path and V-tile, AR's bits),
            # at its fastest tiling: the dispatch's route for the demo's trees, timed here at the
            # paper's shape, where the dispatch does not send trees to it
            "paths_ms": paths_sweep[paths_tiling], "paths_tiling": paths_tiling,
            "paths_x": ms["r2l"] / paths_sweep[paths_tiling], "paths_sweep_ms": paths_sweep,
            # what dispatch runs for a branching topology outside exact mode
            "dispatch_ms": ms["parallel"],
            "paper_hybrid_x": paper[3] if paper else None,
        })
    return rows


def cost_fit(rows: list[dict], layers: int) -> dict:
    """`schedule.SERIAL_COST` refitted to this run's Table 1 (µs per layer), by least squares:
    the serial pass as node·n + restore·restores, then, with those two, the hybrid as
    hybrid_fixed + hybrid_node·n + its critical path. Each row's terms are averaged over the
    row's trees, as its times are. `current` is the model in the code, `rms_us` each fit's
    residual, `choices` how many trees each model sends to the route that measured faster
    (serial pass or hybrid): a fit of the times is not a fit of the choice, so compare both
    before moving `SERIAL_COST`."""
    from specla.ops.gdn import schedule

    terms, trees_of = [], []  # per row: (n, restores, [(depth, hops) per tree]); its parent arrays
    for r in rows:
        trees = [torch.tensor([beam_tree(r["topk"], r["depth"], r["nodes"], seed=s)]) for s in range(r["trees"])]
        trees_of.append(trees)
        per = [schedule.cost_terms(p) for p in trees]
        terms.append((trees[0].shape[1], statistics.mean(float(t[0]) for t in per), [(t[1][0], t[2][0]) for t in per]))
    us = lambda key: torch.tensor([r[key] * 1e3 / layers for r in rows], dtype=torch.float64)  # noqa: E731

    def lstsq(A, y):
        """Non-negative least squares in two unknowns: the unconstrained fit, else the better of
        the fits with one of them pinned at 0 (a cost cannot be negative; six Table 1 rows,
        whose restores grow with their size, can ask for one)."""
        A = torch.tensor(A, dtype=torch.float64)
        best = None
        for cols in ([0, 1], [0], [1]):
            x = torch.zeros(2, dtype=torch.float64)
            x[cols] = torch.linalg.lstsq(A[:, cols], y[:, None]).solution[:, 0]
            rms = float((A @ x - y).pow(2).mean().sqrt())
            if bool((x >= 0).all()) and (best is None or rms < best[1] - 1e-12):
                best = (x.tolist(), rms)
        return best

    (node, restore), rms_serial = lstsq([[n, rs] for n, rs, _ in terms], us("serial_ms"))
    crit = torch.tensor([statistics.mean(float((node * d + restore * h).max()) for d, h in trees)
                         for _, _, trees in terms], dtype=torch.float64)
    (fixed, hnode), rms_hybrid = lstsq([[1.0, n] for n, _, _ in terms], us("hybrid_ms") - crit)
    fitted = {"node": node, "restore": restore, "hybrid_fixed": fixed, "hybrid_node": hnode}
    choices = {name: sum(bool(schedule.prefer_serial(p, model)) == (r["serial_ms"] <= r["hybrid_ms"])
                         for r, ps in zip(rows, trees_of) for p in ps)
               for name, model in (("current", schedule.SERIAL_COST), ("fitted", fitted))}
    return {**fitted, "rms_us": {"serial": rms_serial, "hybrid": rms_hybrid}, "current": dict(schedule.SERIAL_COST),
            "choices": {**choices, "trees": sum(len(ps) for ps in trees_of)}}


def commit_section(bench: Bench) -> list[dict]:
    """Accepted-state recovery over all layers: token replay through the model vs factor commit.

    factor_ms is what `Cache.commit` runs per layer (conv-state shift + GDN factor update);
    gdn_commit_ms the GDN commit kernel alone.
    """
    from specla.ops.conv import triton as conv_triton
    from specla.ops.gdn import commit
    from specla.shapes import random_model

    model = random_model("gdn-1.3b-paper" if not bench.quick else "tiny", device=bench.device, dtype=torch.bfloat16)
    cfg = model.cfg
    n = 9  # an 8-draft chain plus its root: the widest accepted path
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (1, 8), generator=g).to(bench.device)
    cache = model.new_cache(1, max_len=64)
    recs = []
    for layer in range(cfg.num_hidden_layers):
        x = torch.randn(1, n, cfg.conv_dim, generator=g).to(bench.device, torch.bfloat16)
        k = torch.nn.functional.normalize(torch.randn(1, n, cfg.num_heads, cfg.head_dim, generator=g), dim=-1)
        gl = -(torch.rand(1, n, cfg.num_v_heads, generator=g) * 0.5 + 0.01)
        u = torch.randn(1, n, cfg.num_v_heads, cfg.head_v_dim, generator=g) * 0.1
        recs.append((x, k.to(bench.device), gl.to(bench.device), u.to(bench.device)))
    path = torch.arange(8, device=bench.device)[None]
    rows = []
    for A in (range(1, 9) if not bench.quick else (1, 4)):
        length = torch.tensor([A], device=bench.device)

        def factor():
            for st, (x, k, gl, u) in zip(cache.layers, recs):
                conv_triton.conv_commit(st.conv, x, path, length)
                commit.gdn_commit(st.S, k, gl, u, path, length)

        replay = bench.time_ms(lambda: model.forward(tokens[:, :A], cache))
        fac = bench.time_ms(factor)
        gdn = bench.time_ms(lambda: [commit.gdn_commit(st.S, k, gl, u, path, length)
                                     for st, (_, k, gl, u) in zip(cache.layers, recs)])
        rows.append({"length": A, "replay_ms": replay, "factor_ms": fac, "gdn_commit_ms": gdn,
                     "speedup_x": replay / fac})
    return rows


def fused_section(bench: Bench, tiling: dict) -> list[dict]:
    """Delayed update: commit A accepted factors, then verify a 4-draft chain (5 tokens).

    Verify alone and the fused kernel each get their own best tiling, swept at A = 4 over
    `tilings` (recorded per row as verify_config / fused_config)."""
    from specla.ops.gdn import commit, serial
    from specla.topology import chain

    scale = bench.K ** -0.5
    n, P = 5, 8
    par = chain(n, device=bench.device)
    ins = bench.layer_inputs(n, 7)
    path = torch.arange(P, device=bench.device)[None]
    sweep_pend = bench.pending(P, 4 if not bench.quick else 1, 8)
    sweep = []
    for opt in tilings(bench.quick):
        v = bench.time_ms(lambda: [serial.gdn_tree_verify(*x, par, scale, chain=True, **opt) for x in ins])
        f = bench.time_ms(lambda: [serial.gdn_tree_verify(*x, par, scale, sweep_pend, chain=True, **opt) for x in ins])
        sweep.append({**opt, "verify_24_ms": v, "fused_24_ms": f})
    vcfg = {k: min(sweep, key=lambda r: r["verify_24_ms"])[k] for k in ("block_v", "num_warps")}
    fcfg = {k: min(sweep, key=lambda r: r["fused_24_ms"])[k] for k in ("block_v", "num_warps")}
    rows = []
    verify_only = bench.time_ms(lambda: [serial.gdn_tree_verify(*x, par, scale, chain=True, **vcfg) for x in ins])
    for A in (range(1, 9) if not bench.quick else (1, 4)):
        pend = bench.pending(P, A, 8)

        def separate():
            for x in ins:
                commit.gdn_commit(x[5], *pend[:3], path, pend[3])
                serial.gdn_tree_verify(*x, par, scale, chain=True, **vcfg)

        sep = bench.time_ms(separate)
        fused = bench.time_ms(lambda: [serial.gdn_tree_verify(*x, par, scale, pend, chain=True, **fcfg) for x in ins])
        L = bench.layers
        rows.append({"accepted": A, "separate_ms": sep / L, "fused_ms": fused / L, "verify_only_ms": verify_only / L,
                     "separate_24_ms": sep, "fused_24_ms": fused, "verify_only_24_ms": verify_only,
                     "fused_over_verify": fused / verify_only, "verify_config": vcfg, "fused_config": fcfg,
                     "sweep": sweep if A == 1 else None})
    return rows


def chain_section(bench: Bench, tiling: dict, bandwidth: float) -> list[dict]:
    """Chain verification per T: every tiling in the same run, the best one's time as `ms`
    (its tiling in `picked`), the Table 1 tiling's as `ms_tiling`."""
    from specla.ops.gdn import serial
    from specla.topology import chain

    fla = _fla_recurrent()
    scale = bench.K ** -0.5
    floor_ms = 2 * bench.HV * bench.K * bench.V * 4 / bandwidth * 1e3  # state read + written once
    rows = []
    for T in (range(1, 17) if not bench.quick else (1, 4)):
        par = chain(T, device=bench.device)
        ins = bench.layer_inputs(T, 9)
        cands = []
        for opt in tilings(bench.quick):
            ms = bench.time_ms(lambda: [serial.gdn_tree_verify(*x, par, scale, chain=True, **opt) for x in ins])
            cands.append({**opt, "ms": ms / bench.layers})
        best = min(cands, key=lambda r: r["ms"])
        at_tiling = [c["ms"] for c in cands if c["block_v"] == tiling["block_v"]
                     and c["num_warps"] == tiling["num_warps"]]
        fla_ms = None
        if fla is not None:
            fla_ms = bench.time_ms(lambda: [fla(q=x[0], k=x[1], v=x[2], g=x[3], beta=x[4], scale=scale,
                                                initial_state=x[5], output_final_state=False) for x in ins])
            fla_ms /= bench.layers
        rows.append({"T": T, "ms": best["ms"], "ms_tiling": at_tiling[0] if at_tiling else None,
                     "floor_ms": floor_ms, "fla_ms": fla_ms,
                     "picked": {k: best[k] for k in ("block_v", "num_warps")}, "candidates": cands})
    return rows


def _err(out, ref) -> dict:
    d = (out.double() - ref.double())
    return {"max_abs": float(d.abs().max()), "rel": float(d.norm() / ref.double().norm().clamp(min=1e-30))}


def correctness(bench: Bench) -> dict:
    """Every kernel against its torch reference (fp32) at the benchmark shape, one layer."""
    from specla.ops.conv import naive as conv_ref
    from specla.ops.conv import triton as conv_triton
    from specla.ops.gdn import commit, hybrid, naive, parallel, paths, serial
    from specla.topology import root_to_leaf_paths

    dev = bench.device
    scale = bench.K ** -0.5
    fp32 = Bench(dev, bench.H, bench.HV, bench.K, bench.V, 1, torch.float32, bench.quick)
    nodes = 32 if not bench.quick else 8
    p = beam_tree(4, 4, nodes, seed=0)
    par = torch.tensor([p], device=dev)
    q, k, v, g, beta, S = fp32.layer_inputs(len(p), 11)[0]
    pend = fp32.pending(8, 5, 12)
    out = {}
    S_ref = S.clone()
    ro, ru = naive.gdn_tree_verify(q, k, v, g, beta, S_ref, par, scale, pend)
    for name, fn in (("serial", serial.gdn_tree_verify), ("hybrid", hybrid.gdn_tree_verify),
                     ("hybrid_auto", lambda *a: hybrid.gdn_tree_verify(*a, schedule="auto")),
                     ("parallel", parallel.gdn_tree_verify),
                     *((f"paths_bv{t['block_v']}_w{t['num_warps']}", lambda *a, t=t: paths.gdn_tree_verify(*a, **t))
                       for t in tilings(bench.quick, PATHS_TILINGS))):
        S_out = S.clone()
        o, u = fn(q, k, v, g, beta, S_out, par, scale, pend)
        out[f"verify_{name}"] = {"o": _err(o, ro), "u": _err(u, ru), "state": _err(S_out, S_ref)}

    # the hybrid's schedule is data: capture with one tree, replay with another of the same size
    if bench.cuda:
        p2 = beam_tree(2, 24, nodes, seed=3)
        st = S.clone()
        static = par.clone()
        graph = capture_graph(lambda: hybrid.gdn_tree_verify(q, k, v, g, beta, st, static, scale))
        go, gu = graph.out
        static.copy_(torch.tensor([p2], device=dev))
        graph.replay()
        ro2, ru2 = naive.gdn_tree_verify(q, k, v, g, beta, S.clone(), static, scale)
        out["hybrid_graph_replay_new_topology"] = {"o": _err(go, ro2), "u": _err(gu, ru2)}
        static.copy_(par)  # the parallel verifier's ancestor mask is computed inside its graph
        graph = capture_graph(lambda: parallel.gdn_tree_verify(q, k, v, g, beta, st, static, scale))
        go, gu = graph.out
        static.copy_(torch.tensor([p2], device=dev))
        graph.replay()
        out["parallel_graph_replay_new_topology"] = {"o": _err(go, ro2), "u": _err(gu, ru2)}

    path = torch.tensor([[0] + [c for c in root_to_leaf_paths(torch.tensor(p))[0][1:]][:7]], device=dev)
    length = torch.tensor([path.shape[1] - 1], device=dev)
    S_ref, S_out = S.clone(), S.clone()
    naive.gdn_commit(S_ref, k, g, ru, path, length)
    commit.gdn_commit(S_out, k, g, ru, path, length)
    out["commit"] = _err(S_out, S_ref)

    C = 3 * bench.H * bench.K if not bench.quick else 48
    x = torch.randn(1, len(p), C, device=dev)
    cs = torch.randn(1, C, 3, device=dev)
    w = torch.randn(C, 4, device=dev)
    out["tree_conv"] = _err(conv_triton.tree_conv(x, cs, w, None, par), conv_ref.tree_conv(x, cs, w, None, par))
    a, b = cs.clone(), cs.clone()
    conv_ref.conv_commit(a, x, path, length)
    conv_triton.conv_commit(b, x, path, length)
    out["conv_commit"] = _err(b, a)

    from specla.topology import chain

    for T in (1, 5):
        qc, kc, vc, gc, bc, Sc = fp32.layer_inputs(T, 14)[0]
        pc = chain(T, device=dev)
        S_ref = Sc.clone()
        ro, ru = naive.gdn_tree_verify(qc, kc, vc, gc, bc, S_ref, pc, scale, pend)
        for bv, nw in ((8, 1), (16, 4)):
            S_out = Sc.clone()
            o, u = serial.gdn_tree_verify(qc, kc, vc, gc, bc, S_out, pc, scale, pend, chain=True,
                                          block_v=bv, num_warps=nw)
            out[f"chain_T{T}_bv{bv}_w{nw}"] = {"o": _err(o, ro), "u": _err(u, ru), "state": _err(S_out, S_ref)}

    T = 16
    qs, ks, vs, gs, bs, Ss = fp32.layer_inputs(T, 13)[0]
    S_ref, S_out = Ss.clone(), Ss.clone()
    r = naive.gdn_recurrent(qs, ks, vs, gs, bs, S_ref, scale)
    o = serial.gdn_chain_sequence(qs, ks, vs, gs, bs, S_out, scale)
    out["sequence_serial"] = {"o": _err(o, r), "state": _err(S_out, S_ref)}

    fla = _fla_recurrent()
    if fla is not None:
        for name, fn in (("hybrid", hybrid.gdn_tree_verify), ("parallel", parallel.gdn_tree_verify)):
            ho, _ = fn(q, k, v, g, beta, S.clone(), par, scale)
            worst = {"max_abs": 0.0, "rel": 0.0}
            for pth in root_to_leaf_paths(torch.tensor(p)):
                idx = torch.tensor(pth, device=dev)
                fo, _ = fla(q=q[:, idx], k=k[:, idx], v=v[:, idx], g=g[:, idx], beta=beta[:, idx], scale=scale,
                            initial_state=S.clone(), output_final_state=False)
                e = _err(ho[:, idx], fo)
                worst = {key: max(worst[key], e[key]) for key in worst}
            out[f"{name}_vs_fla_recurrent_paths"] = worst
    return out


def picked(result: dict) -> dict:
    """Every configuration the run chose from its own sweeps (sections that ran)."""
    ok = lambda key: isinstance(result.get(key), list)  # noqa: E731
    out = {"tiling": result.get("tiling_used")}
    if ok("chain"):
        out["chain"] = {str(r["T"]): r["picked"] for r in result["chain"]}
    if ok("fused") and result["fused"]:
        out["fused"] = {"verify": result["fused"][0]["verify_config"], "fused": result["fused"][0]["fused_config"]}
    if ok("table1"):
        out["hybrid_schedule"] = {f"k{r['topk']}_d{r['depth']}_n{r['nodes']}": r["hybrid_schedule"]
                                  for r in result["table1"]}
    return out


def goals(result: dict) -> dict:
    """The issue's targets, for the sections that ran."""
    ok = lambda key: isinstance(result.get(key), list)  # noqa: E731  (a failed section holds its error)
    g = {}
    if ok("table1"):
        g["hybrid_at_least_paper_ratio_over_r2l"] = all(
            r["paper_hybrid_x"] is None or r["hybrid_x"] >= r["paper_hybrid_x"] for r in result["table1"])
        g["parallel_at_least_paper_ratio_over_r2l"] = all(
            r["paper_hybrid_x"] is None or r["parallel_x"] >= r["paper_hybrid_x"] for r in result["table1"])
        g["hybrid_auto_not_slower_than_serial"] = all(r["hybrid_auto_ms"] <= r["serial_ms"] for r in result["table1"])
        g["dispatch_not_slower_than_serial"] = all(r["dispatch_ms"] <= r["serial_ms"] for r in result["table1"])
    if ok("commit"):
        g["factor_commit_at_least_10x_replay"] = all(r["speedup_x"] >= 10 for r in result["commit"])
    if ok("fused"):
        g["fused_within_5pct_of_verify"] = all(r["fused_over_verify"] <= 1.05 for r in result["fused"])
    if ok("chain") and all(r["fla_ms"] is not None for r in result["chain"]):
        g["serial_chain_not_slower_than_fla"] = all(r["ms"] <= r["fla_ms"] for r in result["chain"])
    return g


def _print(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=180)

    def table(title, rows, cols):
        if not isinstance(rows, list):
            con.print(f"[red]{title}: {rows.get('error') if isinstance(rows, dict) else 'not run'}")
            return
        t = Table(title=title)
        for c in cols:
            t.add_column(c, justify="right")
        for r in rows:
            t.add_row(*[f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols])
        con.print(t)

    if isinstance(result.get("cost_fit"), dict) and "error" not in result["cost_fit"]:
        fit = result["cost_fit"]
        con.print("cost model refitted to Table 1 (µs a layer; schedule.SERIAL_COST):",
                  {k: round(fit[k], 3) for k in fit["current"]}, "in the code:", fit["current"],
                  "trees each sends to the faster route:", fit["choices"])
    if isinstance(result.get("correctness"), dict) and "error" not in result["correctness"]:
        worst = {name: max(e["rel"] for e in (v.values() if "rel" not in v else [v]))
                 for name, v in result["correctness"].items()}
        con.print("correctness (largest relative error per check):", worst)
    table("tiling sweep (serial/hybrid)", result.get("tiling"), ["block_v", "num_warps", "hybrid_4_4_32_ms", "chain_T16_layer_ms"])
    table("Table 1: tree verification, 24 layers (x = speedup over R2L)", result.get("table1"),
          ["topk", "depth", "nodes", "leaves", "serial_restores", "r2l_ms", "serial_ms", "parallel_ms", "hybrid_ms", "hybrid_auto_ms",
           "paths_ms", "paths_tiling", "hybrid_schedule", "serial_x", "parallel_x", "hybrid_x", "paths_x",
           "paper_hybrid_x"])
    table("accepted-state recovery, 24 layers", result.get("commit"),
          ["length", "replay_ms", "factor_ms", "gdn_commit_ms", "speedup_x"])
    table("delayed update, verify 4-draft chain, per layer", result.get("fused"),
          ["accepted", "separate_ms", "fused_ms", "verify_only_ms", "fused_over_verify", "verify_config",
           "fused_config"])
    table("serial chain verifier, per layer", result.get("chain"), ["T", "ms", "ms_tiling", "floor_ms", "fla_ms", "picked"])
    con.print("picked:", result.get("picked"))
    con.print("goals:", result["goals"])


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = lambda key: isinstance(result.get(key), list)  # noqa: E731
    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    if ran("table1"):
        t1 = result["table1"]
        labels = [f"k{r['topk']} d{r['depth']} n{r['nodes']}" for r in t1]
        xs = range(len(t1))
        bars = (("serial_x", "serial"), ("parallel_x", "parallel"), ("hybrid_x", "hybrid"), ("paths_x", "paths"))
        for i, (key, name) in enumerate(bars):
            ax[0, 0].bar([x + (i - 1.5) * 0.2 for x in xs], [r.get(key, 0) for r in t1], 0.2, label=name)
        ax[0, 0].scatter(list(xs), [r["paper_hybrid_x"] or 0 for r in t1], marker="_", s=400, c="k",
                         label="paper hybrid")
        ax[0, 0].set_xticks(list(xs), labels, rotation=20)
        ax[0, 0].set_ylabel("speedup over R2L")
        ax[0, 0].set_title("tree verification, 24 layers")
        ax[0, 0].legend()
    if ran("commit"):
        c = result["commit"]
        ax[0, 1].plot([r["length"] for r in c], [r["replay_ms"] for r in c], "o-", label="token replay")
        ax[0, 1].plot([r["length"] for r in c], [r["factor_ms"] for r in c], "o-", label="factor commit")
        ax[0, 1].set_yscale("log")
        ax[0, 1].set_xlabel("accepted length")
        ax[0, 1].set_ylabel("ms (24 layers)")
        ax[0, 1].set_title("accepted-state recovery")
        ax[0, 1].legend()
    if ran("fused"):
        f = result["fused"]
        for key, name in (("separate_ms", "commit + verify"), ("fused_ms", "fused"), ("verify_only_ms", "verify only")):
            ax[1, 0].plot([r["accepted"] for r in f], [r[key] * 1e3 for r in f], "o-", label=name)
        ax[1, 0].set_xlabel("accepted (pending) length")
        ax[1, 0].set_ylabel("µs per layer")
        ax[1, 0].set_title("delayed update, 4-draft chain")
        ax[1, 0].legend()
    if ran("chain"):
        ch = result["chain"]
        ax[1, 1].plot([r["T"] for r in ch], [r["ms"] * 1e3 for r in ch], "o-", label="specla serial")
        if all(r["fla_ms"] is not None for r in ch):
            ax[1, 1].plot([r["T"] for r in ch], [r["fla_ms"] * 1e3 for r in ch], "o-", label="fla fused_recurrent")
        ax[1, 1].plot([r["T"] for r in ch], [r["floor_ms"] * 1e3 for r in ch], "--", label="state traffic floor")
        ax[1, 1].set_xlabel("chain tokens T")
        ax[1, 1].set_ylabel("µs per layer")
        ax[1, 1].set_title("chain verification")
        ax[1, 1].legend()
    fig.suptitle(f"{result['device']} — {result['date']} — {(result['code_commit'] or '')[:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(out_dir: str = "benchmarks/results", device: str = "cuda", quick: bool = False) -> dict:
    dev = torch.device(device)
    if dev.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel modules are imported
        from specla.ops.gdn import serial

        if type(serial.tree_verify_kernel).__name__ != "InterpretedFunction":
            raise RuntimeError("on CPU the kernels need TRITON_INTERPRET=1 set before specla's kernels are imported")
        bench = Bench(dev, 1, 2, 16, 16, 1 if quick else 2, torch.bfloat16, True)
    else:
        bench = Bench(dev, 8, 8, 256, 256, 24, torch.bfloat16, quick)
    t0 = time.perf_counter()
    timings = {}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "kernels" if bench.cuda else "kernels_cpu_smoke"

    def section(name, fn, *args):
        """Run one section; a failure is recorded in its place and the others still run. The
        JSON is rewritten after every section, so a run cut short keeps what it measured."""
        t = time.perf_counter()
        try:
            result[name] = fn(*args)
        except Exception as e:  # noqa: BLE001  (one GPU call must return whatever it can)
            result[name] = {"error": repr(e), "traceback": traceback.format_exc()}
            print(result[name]["traceback"], file=sys.stderr)
        timings[name] = round(time.perf_counter() - t, 1)
        result["bench_seconds"] = timings
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
        return result[name]

    env = environment()
    env["code_commit"] = env.pop("commit")
    result = {
        **env,
        "shape": {"H": bench.H, "HV": bench.HV, "K": bench.K, "V": bench.V, "layers": bench.layers,
                  "activations": str(bench.act), "state": "torch.float32"},
        "timing": "CUDA graph replay, median of triton.testing.do_bench (L2 flushed)" if bench.cuda else "CPU interpreter, meaningless",
    }
    bandwidth = section("copy_bandwidth_Bps", copy_bandwidth, bench)
    section("correctness", correctness, bench)
    sweep = section("tiling", tiling_sweep, bench)
    tiling = pick_tiling(sweep) if isinstance(sweep, list) else {"block_v": 16, "num_warps": 4}
    result["tiling_used"] = tiling
    rows = section("table1", table1, bench, tiling)
    if isinstance(rows, list):
        section("cost_fit", cost_fit, rows, bench.layers)
    section("commit", commit_section, bench)
    section("fused", fused_section, bench, tiling)
    if isinstance(bandwidth, float):
        section("chain", chain_section, bench, tiling, bandwidth)
    result["picked"] = picked(result)
    result["goals"] = goals(result)
    timings["total"] = round(time.perf_counter() - t0, 1)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    section("plot", _plot, result, out / f"{stem}.png")
    result.pop("plot", None)
    _print(result)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    run(a.out, a.device, a.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
