"""`specla bench rounds`: where a speculative round's time goes, on real prompts.

For each route, generates a few prompts of a suite with the checkpoint's drafter and times
every phase of every round: the drafter's `propose` and `extend`, the target's `round`
(verify, accept, settle, commit; `ar_round` for AR). Each phase gets two numbers: its span
on the GPU timeline (CUDA events around the call, no extra synchronisation) and the host
time spent issuing it. Each route runs twice in the same process: running ahead of the host
(the default loop on CUDA graphs) and reading every round before the next
(`pipeline=False`), so the gain of running ahead is a same-run ratio. Reading every round,
a round's wall time minus its phases is the loop's own work (the host read, Python);
running ahead, that work overlaps the next round and the wall time per round is what counts.
One more generation per route runs under torch.profiler for kernels and GPU busy time per round.

`warm_routes`: routes that each generate once, untimed, before anything is timed, so a route
can be timed in a process with the history `bench e2e`'s has (every route of a prompt back to
back in one process). The tree route ran 1.41× slower per round there than alone (docs/benchmark-log.md,
end-to-end section); `--warm-routes ar,fla,chain,ngram --routes tree` against `--routes tree`
isolates that.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import torch

from specla.bench.common import RESULTS, warm_set, write_results
from specla.bench.e2e import route_options

PHASES = {"drafter": ("propose", "extend"), "target": ("round", "ar_round")}


class _Timer:
    """Wraps methods of an object (instance attributes shadow them) to record each call. A
    call made inside another timed call (an exact-mode AR step runs as a round) is part of the
    outer one and not recorded again."""

    def __init__(self):
        self.calls: list[tuple[str, object, object, float]] = []
        self.wrapped: list[tuple[object, str]] = []
        self.depth = 0

    def wrap(self, obj, name: str) -> None:
        if obj is None or not hasattr(obj, name):
            return
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            e0.record()
            self.depth += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                self.depth -= 1
            e1.record()
            self.calls.append((name, e0, e1, time.perf_counter() - t0))
            return out

        setattr(obj, name, timed)
        self.wrapped.append((obj, name))

    def unwrap(self) -> None:
        for obj, name in self.wrapped:
            delattr(obj, name)
        self.wrapped.clear()

    def totals(self) -> dict:
        torch.cuda.synchronize()
        gpu, host, n = defaultdict(float), defaultdict(float), defaultdict(int)
        for name, e0, e1, h in self.calls:
            gpu[name] += e0.elapsed_time(e1)
            host[name] += h * 1e3
            n[name] += 1
        return {k: {"calls": n[k], "gpu_ms": gpu[k], "host_ms": host[k]} for k in n}


def run(model_dir=None, routes=("ar", "chain", "tree", "ngram"), suite: str = "mixed", n_prompts: int = 8,
        max_new_tokens: int = 128, device: str = "auto", dtype: str = "auto", out_dir=RESULTS,
        profile: bool = True, compile: str | None = None, warm_routes=(), name: str = "rounds") -> dict:
    import specla.api as api
    from specla.bench.decode import profile_fn
    from specla.data.suites import load_suite

    lm = api.load(model_dir, device=device, dtype=dtype, compile=compile)
    if lm.model.device.type != "cuda":
        raise SystemExit("bench rounds times CUDA work: run it on a GPU")
    prompts = [p.turns[0] for p in load_suite(suite, limit=n_prompts)]
    warm = warm_set(((len(lm.encode_prompt(p)), p) for p in prompts), max_new_tokens)
    for route in warm_routes:
        lm.generate(prompts[0], max_new_tokens=max_new_tokens, **route_options(route))
    rows = []
    for route, pipeline in [(r, p) for r in routes for p in (True, False)]:
        kw = dict(route_options(route), pipeline=pipeline)
        for text in warm:  # build, compile, capture (a graph per drafter attention window)
            lm.generate(text, max_new_tokens=max_new_tokens, **kw)
        timer = _Timer()
        for drafter in {id(d): d for d in lm._drafters.values() if d is not None}.values():
            for phase in PHASES["drafter"]:
                timer.wrap(drafter, phase)
        for target in lm._targets.values():
            for phase in PHASES["target"]:
                timer.wrap(target, phase)
        rounds = tokens = 0
        wall = 0.0
        try:
            for p in prompts:
                g = lm.generate(p, max_new_tokens=max_new_tokens, **kw)
                rounds += g.rounds
                tokens += len(g.tokens)
                wall += g.decode_seconds
        finally:
            phases = timer.totals()
            timer.unwrap()
        row = {"route": route if pipeline else f"{route} (host read)", "pipeline": pipeline, "prompts": len(prompts), "rounds": rounds, "tokens": tokens,
               "round_ms": wall * 1e3 / rounds, "ms_per_token": wall * 1e3 / tokens,
               "phases": {k: {"gpu_ms_per_round": v["gpu_ms"] / rounds, "host_ms_per_round": v["host_ms"] / rounds,
                              "calls_per_round": v["calls"] / rounds} for k, v in phases.items()}}
        row["loop_ms_per_round"] = row["round_ms"] - sum(v["gpu_ms_per_round"] for v in row["phases"].values())
        if profile:
            g = {}

            def once():
                g["r"] = lm.generate(prompts[0], max_new_tokens=max_new_tokens, **kw)

            prof = profile_fn(once, 1, lm.model.device, top=40)
            n = g["r"].rounds
            row["profile"] = {"rounds": n, "kernels_per_round": prof["kernels_per_step"] / n,
                              "gpu_busy_ms_per_round": prof["gpu_us_per_step"] / n / 1e3,
                              "top": [dict(t, us_per_round=t["us_per_step"] / n) for t in prof["top"]]}
        rows.append(row)
    _print(rows)
    result = {"model": str(lm.model_dir), "suite": suite, "max_new_tokens": max_new_tokens,
              "dtype": str(lm.model.dtype).replace("torch.", ""), "warm_routes": list(warm_routes), "routes": rows}
    write_results(name, result, Path(out_dir))
    return result


def _print(rows) -> None:
    from rich.console import Console
    from rich.table import Table

    names = sorted({k for r in rows for k in r["phases"]})
    t = Table(title="ms per round: GPU-timeline span / host issue time per phase")
    for c in ["route", "rounds", "round ms", "ms/token", *names, "loop", "kernels", "GPU busy"]:
        t.add_column(c)
    for r in rows:
        ph = [f"{r['phases'][k]['gpu_ms_per_round']:.3f}/{r['phases'][k]['host_ms_per_round']:.3f}"
              if k in r["phases"] else "" for k in names]
        p = r.get("profile", {})
        t.add_row(r["route"], str(r["rounds"]), f"{r['round_ms']:.3f}", f"{r['ms_per_token']:.3f}", *ph,
                  f"{r['loop_ms_per_round']:.3f}", f"{p.get('kernels_per_round', 0):.0f}",
                  f"{p.get('gpu_busy_ms_per_round', 0):.3f}")
    Console(width=160).print(t)
