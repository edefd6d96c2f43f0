"""Why a drafted route's prefill costs more than AR's on short prompts: the prefill phase of
`Decoder.run` (the target's chunks, the drafter's prompt extend) timed per route and prompt
length, then profiled once per route with CPU and CUDA activities, so eager host ops, graph
launches and kernels can be counted side by side.

    python benchmarks/diagnostics/prefill_routes.py [--lengths 8,16,32,64,100] [--kernels 100] [--out FILE]

--kernels N also profiles the GPU kernels of an N-token prefill per route (`profile_fn`: kernels,
GPU time and the top kernels a prefill), to see what a prompt of the suites' usual length costs.

Runs the demo pair (SPECLA_COMPILE=1 for the fused path, as bench e2e runs it). The prefill is
`Decoder.prefill`, timed as `Decoder.run` times it (after `Decoder.start`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import specla.api as api
from specla.bench.common import environment
from specla.bench.decode import profile_fn
from specla.decode import Decoder, _sync

ROUTES = ("ar", "chain", "tree")


def _decoder(lm, route: str) -> Decoder:
    # the drafter the warm-up generations compiled and captured (until 2026-12-07 this built its
    # own cache key, which no longer matched the API's: prefill_routes_e81b74a_h100.json's chain
    # and tree rows timed fresh drafters)
    return Decoder(lm.model, lm.served_drafter(route), route, targets=lm._targets)


def _top(events, n=25):
    agg: dict = {}
    for e in events:
        c = agg.setdefault(e.name, [0, 0.0])
        c[0] += 1
        c[1] += e.self_cpu_time_total
    return [{"name": k[:80], "count": v[0], "self_cpu_us": round(v[1], 1)}
            for k, v in sorted(agg.items(), key=lambda kv: -kv[1][0])[:n]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8,16,24,32,48,64,100")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--kernels", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lm = api.load(None, device="auto")
    dev = lm.model.device
    vocab = lm.model.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.kernels:
        lengths = sorted(set(lengths) | {args.kernels})
    prompts = {n: torch.randint(3, vocab, (1, n), generator=gen) for n in lengths}
    res = {"timing_ms": {}, "profile": {}, "kernels": {}}
    for route in ROUTES:
        for n in lengths:  # warm: compile, capture every graph these prompts take
            lm.generate(prompts[n][0].tolist(), route=route, max_new_tokens=16)
        dec = _decoder(lm, route)
        res["timing_ms"][route] = {}
        for n in lengths:
            ts = []
            for _ in range(args.reps):
                target = dec.start(1, n + 16)
                _sync(dev)
                t = time.perf_counter()
                dec.prefill(target, prompts[n].to(dev))
                _sync(dev)
                ts.append((time.perf_counter() - t) * 1e3)
            res["timing_ms"][route][n] = statistics.median(ts)
        if args.kernels and dev.type == "cuda":
            k = args.kernels
            res["kernels"][route] = {"prompt_tokens": k, **profile_fn(
                lambda: dec.prefill(dec.start(1, k + 16), prompts[k].to(dev)), 5, dev)}
        n = lengths[len(lengths) // 2]
        from torch.profiler import ProfilerActivity, profile

        target = dec.start(1, n + 16)
        _sync(dev)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            dec.prefill(target, prompts[n].to(dev))
            _sync(dev)
        ev = prof.events()
        cpu = [e for e in ev if e.device_type == torch.autograd.DeviceType.CPU]
        res["profile"][route] = {
            "prompt_tokens": n,
            "cpu_ops": len([e for e in cpu if e.name.startswith("aten::")]),
            "graph_launches": len([e for e in cpu if e.name == "cudaGraphLaunch"]),
            "kernel_launches": len([e for e in cpu if e.name in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                    "cudaLaunchKernelExC", "cuLaunchKernelEx")]),
            "memcpy": len([e for e in cpu if "Memcpy" in e.name or "memcpy" in e.name.lower()]),
            "top_cpu": _top(cpu),
        }
    print(json.dumps(res["timing_ms"], indent=1))
    for route, p in res["kernels"].items():
        print(route, "kernels of a", p["prompt_tokens"], "token prefill:",
              {k: v for k, v in p.items() if k != "top"})
        for t in p["top"][:20]:
            print("   ", t)
    for route, p in res["profile"].items():
        print(route, {k: v for k, v in p.items() if k != "top_cpu"})
        for t in p["top_cpu"]:
            print("   ", t)
    if args.out:
        Path(args.out).write_text(json.dumps({**environment(), **res}, indent=1))


if __name__ == "__main__":
    main()
