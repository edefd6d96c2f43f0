"""Where a round's host time goes, per route, on the demo pair. `bench rounds` at 81f2b3f put
~1.0 ms of host time in a tree round's phases against ~0.9 ms of GPU work (the chain: ~0.5
against 0.73), which would make trees host-bound; this measures what the host does.
host_time_d18c594.json: each replay costs 9-15 us of host time, and both routes wait on the GPU
for a good part of every round (BENCHMARKS.md).

For each route: the generations of `bench rounds` (warm-up, then N prompts), with
- every CUDA graph replay's host time, by graph (target round, drafter rollout per window,
  drafter extend per width);
- the drafter's cache-room checks that read the device (`kv_room` falling back to a sync);
- Python's garbage collections (count and time);
- cProfile of the whole loop: the functions with the most own time, ms a round;
- a generation's time outside its prefill and decode (what `bench e2e` times around them: on
  an H100 at 37fdbd1 1.5-1.7 ms for prompts under 128 tokens), split into the prompt's encoding,
  the target's and drafter's reset (`Decoder.start`, up to the sync before prefill) and the rest.

    SPECLA_COMPILE=1 python benchmarks/diagnostics/host_time.py [--routes ar,chain,tree] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import time
from collections import defaultdict

import torch

import specla.api as api
import specla.decode as decode
import specla.drafters.eagle as eagle
from specla.bench.common import environment, warm_set
from specla.bench.e2e import route_options
from specla.data.suites import load_suite


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--routes", default="ar,chain,tree")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    lm = api.load()
    prompts = [p.turns[0] for p in load_suite("mixed", limit=a.n_prompts)]
    warm = warm_set(((len(lm.encode_prompt(p)), p) for p in prompts), a.max_new_tokens)

    replays = defaultdict(list)  # id(graph) -> host seconds per replay
    orig_replay = torch.cuda.CUDAGraph.replay

    def replay(self):
        t = time.perf_counter()
        orig_replay(self)
        replays[id(self)].append(time.perf_counter() - t)

    syncs = [0, 0]  # room checks, of which read the device
    orig_room = eagle.kv_room

    def kv_room(capacity, bound, extra, length):
        syncs[0] += 1
        syncs[1] += bound + extra > capacity
        return orig_room(capacity, bound, extra, length)

    gcs = [0, 0.0]
    gc_t = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_t[0] = time.perf_counter()
        else:
            gcs[0] += 1
            gcs[1] += time.perf_counter() - gc_t[0]

    spans = defaultdict(list)  # seconds of each call of a timed method, by name

    def timed(fn, name, sync=False):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            if sync:  # the resets' GPU work too
                torch.cuda.synchronize()
            spans[name].append(time.perf_counter() - t)
            return out
        return wrapper

    orig_start, orig_encode = decode.Decoder.start, type(lm).encode_prompt

    rows = []
    for route in a.routes.split(","):
        kw = route_options(route)
        for text in warm:
            lm.generate(text, max_new_tokens=a.max_new_tokens, **kw)
        replays.clear()
        syncs[:] = [0, 0]
        gcs[:] = [0, 0.0]
        torch.cuda.CUDAGraph.replay = replay
        eagle.kv_room = kv_room
        decode.Decoder.start = timed(orig_start, "start", sync=True)
        type(lm).encode_prompt = timed(orig_encode, "encode")
        gc.callbacks.append(on_gc)
        prof = cProfile.Profile()
        rounds = 0
        wall = 0.0
        outside = defaultdict(list)  # ms a generation
        try:
            for p in prompts:  # the timed pass, without the profiler (it slows Python down)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                g = lm.generate(p, max_new_tokens=a.max_new_tokens, **kw)
                torch.cuda.synchronize()
                total = time.perf_counter() - t0
                rounds += g.rounds
                wall += g.decode_seconds
                outside["total"].append(1e3 * (total - g.prefill_seconds - g.decode_seconds))
                for name in ("encode", "start"):
                    outside[name].append(1e3 * spans[name][-1])
            names = _graph_names(lm)
            per_graph = {names.get(k, f"graph {k}"): {"replays_per_round": len(v) / rounds,
                                                      "host_us_median": 1e6 * statistics.median(v),
                                                      "host_us_per_round": 1e6 * sum(v) / rounds}
                         for k, v in replays.items()}
            room = {"checks_per_round": syncs[0] / rounds, "device_reads_per_round": syncs[1] / rounds}
            gc_row = {"collections": gcs[0], "ms_per_round": 1e3 * gcs[1] / rounds}
            outside_row = {k: statistics.median(v) for k, v in outside.items()}
            outside_row["rest"] = outside_row["total"] - outside_row["encode"] - outside_row["start"]
            prof_rounds = 0
            prof.enable()
            for p in prompts[:4]:
                prof_rounds += lm.generate(p, max_new_tokens=a.max_new_tokens, **kw).rounds
            prof.disable()
        finally:
            torch.cuda.CUDAGraph.replay = orig_replay
            eagle.kv_room = orig_room
            decode.Decoder.start = orig_start
            type(lm).encode_prompt = orig_encode
            gc.callbacks.remove(on_gc)
        st = pstats.Stats(prof)
        top = sorted(((v[2], k) for k, v in st.stats.items()), reverse=True)[:30]
        row = {"route": route, "rounds": rounds, "round_ms": 1e3 * wall / rounds, "graphs": per_graph,
               "room": room, "gc": gc_row, "outside_ms_median": outside_row,
               "cprofile_rounds": prof_rounds,
               "cprofile_top": [{"fn": f"{k[0].split('/')[-1]}:{k[1]}:{k[2]}", "own_ms_per_round": 1e3 * t / prof_rounds,
                                 "calls_per_round": st.stats[k][1] / prof_rounds} for t, k in top]}
        rows.append(row)
        print(f"\n== {route}: {rounds} rounds, {row['round_ms']:.3f} ms a round; room {room}; gc {gc_row}")
        print("  outside prefill and decode, ms a generation (median): "
              + ", ".join(f"{k} {v:.3f}" for k, v in outside_row.items()))
        for name, g in sorted(per_graph.items(), key=lambda kv: -kv[1]["host_us_per_round"]):
            print(f"  replay {name:40s} {g['replays_per_round']:.2f}/round  median {g['host_us_median']:.1f} us  "
                  f"{g['host_us_per_round']:.1f} us/round")
        for t in row["cprofile_top"]:
            print(f"  {t['own_ms_per_round']:.4f} ms/round  {t['calls_per_round']:6.2f} calls  {t['fn']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**environment(), "rows": rows}, f, indent=1)


def _graph_names(lm) -> dict:
    names = {}
    for tkey, target in lm._targets.items():
        for key, (graph, _) in getattr(target, "graphs", {}).items():
            names[id(graph)] = f"target {key[0]} b{tkey[2]}"
    for dkey, d in lm._drafters.items():
        if d is None:
            continue
        for W, graph in getattr(d, "_graphs", {}).items():
            names[id(graph)] = f"{dkey[0]} rollout W{W}"
        for key, (graph, _) in getattr(d, "_extend_graphs", {}).items():
            names[id(graph)] = f"{dkey[0]} extend {key}"
    return names


if __name__ == "__main__":
    main()
