"""Where a block drafter's round goes on the GPU: DSpark against ReaDy on the demo pair.

`bench ready` at 9f27ec5 (compiled, 60 prompts a suite) put a ReaDy round ~66 us above a DSpark
round (0.725 against 0.659 ms on mixed) while the fused state-read operator alone takes ~15 us.
This times every CUDA graph replay of a round (CUDA events around each replay: the graph's GPU
time, by graph — the target's verify round, the drafter's block forward per attention window,
its extend per width) for each row over the same prompts, and replays each drafter's
block-forward graph on its own.

    SPECLA_COMPILE=1 python benchmarks/diagnostics/block_round.py --dspark DIR --ready DIR [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch

import specla.api as api
from specla.bench.common import environment, warm_set
from specla.bench.ready import row_drafter, spread_prompts
from specla.data.suites import load_suite
from specla.decode import Decoder


def _names(dec) -> dict:
    names = {}
    for tkey, target in dec.targets.items():
        for key, (graph, _) in getattr(target, "graphs", {}).items():
            names[id(graph)] = f"target {key if isinstance(key, str) else key[0]}"
    d = dec.drafter
    for W, graph in getattr(d, "_graphs", {}).items():
        names[id(graph)] = f"drafter block W{W}"
    for n, (graph, _) in getattr(d, "_extend_graphs", {}).items():
        names[id(graph)] = f"drafter extend n{n}"
    return names


def _kernels(fn, reps: int) -> list[dict]:
    """Kernels of `fn` (a graph replay) under the profiler: device us and launches per call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = []
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", None)
        us = ev.self_cuda_time_total if us is None else us
        if us > 0:
            out.append({"name": ev.key, "us": us / reps, "calls": ev.count / reps})
    return sorted(out, key=lambda k: -k["us"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dspark", required=True)
    ap.add_argument("--ready", required=True)
    ap.add_argument("--suite", default="mixed")
    ap.add_argument("--n-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    lm = api.load()
    model = lm.model
    eos = lm.tokenizer.eos_token_ids | set(model.cfg.eos_token_id)
    prompts = [lm.encode_prompt(p.turns[0]) for p in spread_prompts(load_suite(a.suite), a.n_prompts)]
    warm = warm_set(((len(ids), ids) for ids in prompts), a.max_new_tokens)
    decs = {row: Decoder(model, row_drafter(row, path, model, True, 0.0, False), route="ready",
                         eos_token_ids=eos, graphs=True, delayed=True)
            for row, path in (("dspark", a.dspark), ("ready", a.ready))}
    for dec in decs.values():
        for ids in warm:
            dec.generate(ids, a.max_new_tokens)

    events = []
    orig = torch.cuda.CUDAGraph.replay

    def replay(self):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        orig(self)
        e.record()
        events.append((id(self), s, e))

    rows = []
    for row, dec in decs.items():
        rounds, wall = 0, 0.0
        per = defaultdict(list)
        torch.cuda.CUDAGraph.replay = replay
        try:
            for ids in prompts:
                events.clear()
                res = dec.generate(ids, a.max_new_tokens)
                torch.cuda.synchronize()
                rounds += len(res.rounds)
                wall += res.decode_seconds
                for k, s, e in events:
                    per[k].append(s.elapsed_time(e))
        finally:
            torch.cuda.CUDAGraph.replay = orig
        names = _names(dec)
        graphs = {}
        for k, ts in per.items():
            name = names.get(k, f"graph {k}")
            g = graphs.setdefault(name, {"replays": 0, "ms": []})
            g["replays"] += len(ts)
            g["ms"] += ts
        graphs = {n: {"replays_per_round": g["replays"] / rounds, "gpu_us_median": 1e3 * statistics.median(g["ms"]),
                      "gpu_us_per_round": 1e3 * sum(g["ms"]) / rounds} for n, g in graphs.items()}
        # the widest block-forward graph alone, back to back (its reads are pure once nothing is pending)
        W = max(dec.drafter._graphs)
        graph = dec.drafter._graphs[W]
        for _ in range(5):
            graph.replay()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(200):
            graph.replay()
        e.record()
        torch.cuda.synchronize()
        alone = 1e3 * s.elapsed_time(e) / 200
        kernels = _kernels(graph.replay, 20)
        r = {"row": row, "rounds": rounds, "round_ms": 1e3 * wall / rounds,
             "gpu_us_per_round": sum(g["gpu_us_per_round"] for g in graphs.values()),
             "block_graph_alone_us": alone, "block_graph_window": W, "block_graph_kernels": kernels,
             "graphs": graphs}
        rows.append(r)
        print(f"\n== {row}: {rounds} rounds, {r['round_ms']:.3f} ms a round, graphs' GPU time "
              f"{r['gpu_us_per_round']:.1f} us a round; block graph W{W} alone {alone:.1f} us")
        for n, g in sorted(graphs.items(), key=lambda kv: -kv[1]["gpu_us_per_round"]):
            print(f"  {n:32s} {g['replays_per_round']:.2f}/round  median {g['gpu_us_median']:.1f} us  "
                  f"{g['gpu_us_per_round']:.1f} us/round")
        print(f"  block graph: {len(kernels)} kernel names, {sum(k['calls'] for k in kernels):.0f} launches")
        for k in kernels[:25]:
            print(f"    {k['us']:7.2f} us  x{k['calls']:.0f}  {k['name'][:110]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**environment(), "suite": a.suite, "n_prompts": a.n_prompts, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
