"""Where the time of a graphed AR step and a graphed 16-node round goes, kernel by kernel.

`bench decode --profile` profiles eager steps (the graphs' kernels, but not their launch gaps,
and EagerTarget's commit rather than GraphTarget's round). This profiles replays of the decode
loop's own CUDA graphs (`GraphTarget.ar_round`, `GraphTarget.round` over Table 1's top-4 depth-4
tree of 16 drafts, delayed commit) with CUPTI, which records every kernel a graph launches
with its start and end. A marker kernel (`torch.cuda._sleep`) after each synchronised step
cuts the trace into steps. Per step and kernel class: launches, GPU time, and the idle time
before each kernel (gap: launch latency and dependencies; the first kernel's is not counted).

    SPECLA_COMPILE=1 python benchmarks/diagnostics/graph_timeline.py [--shape gdn-1.3b-paper] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

import torch

from specla.bench.common import environment
from specla.bench.decode import ar_runner, round_runner
from specla.bench.trees import beam_tree
from specla.shapes import random_model

CLASSES = [  # (class, regex on the kernel name), first match wins
    ("gemm", r"nvjet|gemm|gemv|splitK|cutlass|xmma"),
    ("verify", r"products|solve|tree_verify|hybrid|paths"),
    ("prelude", r"prelude|conv"),
    ("gated_norm", r"gated_rms_norm"),
    ("inductor", r"^triton_"),
    ("specla_other", r"_kernel$"),
]


def kind(name: str) -> str:
    for label, pat in CLASSES:
        if re.search(pat, name):
            return label
    return "torch_other"


def _ns(e, what: str) -> float:
    f = getattr(e, what + "_ns", None)
    return float(f()) if f is not None else float(getattr(e, what + "_us")()) * 1e3


def trace(step, steps: int, dev) -> list[list[tuple[str, float, float]]]:
    """Per step: (name, start µs, duration µs) of its GPU activities, in start order."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
            torch.cuda.synchronize(dev)
            torch.cuda._sleep(1000)  # the step marker
            torch.cuda.synchronize(dev)
    ev = sorted(((str(e.name()), _ns(e, "start") / 1e3, _ns(e, "duration") / 1e3)
                 for e in prof.profiler.kineto_results.events() if "CUDA" in str(e.device_type()).upper()),
                key=lambda t: t[1])
    out, cur = [], []
    for e in ev:
        if "sleep" in e[0].lower() or "spin" in e[0].lower():
            out.append(cur)
            cur = []
        else:
            cur.append(e)
    return [s for s in out if s]


def summarise(steps) -> dict:
    per = defaultdict(lambda: [0, 0.0, 0.0])  # name -> launches, busy, gap before
    spans = []
    for s in steps:
        spans.append(s[-1][1] + s[-1][2] - s[0][1])
        end = None
        for name, t0, d in s:
            c = per[name]
            c[0] += 1
            c[1] += d
            if end is not None:
                c[2] += max(0.0, t0 - end)
            end = max(end or 0.0, t0 + d)
    n = len(steps)
    kernels = sorted(({"name": k[:100], "class": kind(k), "launches": v[0] / n, "busy_us": v[1] / n,
                       "gap_us": v[2] / n} for k, v in per.items()), key=lambda r: -(r["busy_us"] + r["gap_us"]))
    classes = defaultdict(lambda: {"launches": 0.0, "busy_us": 0.0, "gap_us": 0.0})
    for r in kernels:
        for key in ("launches", "busy_us", "gap_us"):
            classes[r["class"]][key] += r[key]
    spans.sort()
    return {"steps": n, "span_us_median": spans[n // 2], "launches": sum(r["launches"] for r in kernels),
            "busy_us": sum(r["busy_us"] for r in kernels), "gap_us": sum(r["gap_us"] for r in kernels),
            "classes": dict(classes), "kernels": kernels}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="gdn-1.3b-paper")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    model = random_model(a.shape, device=dev)
    prompt = torch.randint(0, model.cfg.vocab_size, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    parents = beam_tree(4, 4, 16)
    res = {}

    res["ar_step"] = summarise(trace(ar_runner(model, prompt, a.steps + 3), a.steps, dev))
    draw, run, _ = round_runner(model, prompt, parents, a.steps + 3)
    res["round16"] = summarise(trace(lambda: (draw(), run()), a.steps, dev))

    for what, r in res.items():
        print(f"== {what}: span {r['span_us_median']:.0f} µs, {r['launches']:.0f} launches, "
              f"busy {r['busy_us']:.0f} µs, gaps {r['gap_us']:.0f} µs")
        for c, v in sorted(r["classes"].items(), key=lambda kv: -kv[1]["busy_us"]):
            print(f"   {c:14s} {v['launches']:6.1f} launches  busy {v['busy_us']:7.1f}  gaps {v['gap_us']:6.1f}")
    ar_k = {k["name"]: k for k in res["ar_step"]["kernels"]}
    print("== round16 kernels (busy + gap per round; the AR step's beside)")
    for k in res["round16"]["kernels"][:45]:
        o = ar_k.get(k["name"], {"launches": 0, "busy_us": 0, "gap_us": 0})
        print(f"   {k['launches']:5.1f} {k['busy_us']:7.1f} {k['gap_us']:6.1f} | {o['launches']:5.1f} "
              f"{o['busy_us']:7.1f} {o['gap_us']:6.1f}  {k['name'][:80]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**environment(), "shape": a.shape, "tree": parents, "note": __doc__.splitlines()[0],
                       **res}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
