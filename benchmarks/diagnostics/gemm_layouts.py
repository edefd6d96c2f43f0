"""The paper shape's bf16 matmuls at an AR step's 1 row and a 16-node round's 17, by how they
are called: `F.linear` on the [N, K] weight (what the fused path runs, cuBLAS's default
heuristics), the same through cuBLASLt, `x @ Wt` on a [K, N] copy of the weight, and 17 rows
padded to 24 and 32, and (`--inductor`) Inductor's max-autotune choice (Triton templates or
cuBLAS, whichever it measures faster) at 1 and 17 rows. `graph_timeline.py` (fd5f6e5, H100)
put the round's matmuls 108 µs over the AR step's for the same weight bytes; this asks whether
another call gets 17 rows nearer one row's time. Each weight shape as 24 distinct copies (one per layer: no L2 reuse), timed
in one CUDA graph, µs per matmul, with the kernels each call launches.

    python benchmarks/diagnostics/gemm_layouts.py [--inductor] [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from specla.bench.common import environment, graph_time_ms

# gdn-1.3b-paper's per-layer weights (concat_mlp: gate|up as one) and its LM head, [N, K]
WEIGHTS = {"in_proj": (8208, 2048), "o_proj": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632),
           "lm_head": (32000, 2048)}


def _kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--inductor", action="store_true", help="also F.linear compiled with max-autotune (1, 17 rows)")
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    if a.inductor:  # one compile per (weight, rows): ten, past dynamo's default limit of eight
        from specla.fused import _raise_recompile_limit

        _raise_recompile_limit()
    dev = torch.device("cuda")
    out = []
    for name, (N, K) in WEIGHTS.items():
        copies = 1 if name == "lm_head" else 24
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
        wts = [w.t().contiguous() for w in ws]
        for m in (1, 17, 24, 32):
            x = torch.randn(m, K, device=dev, dtype=torch.bfloat16)
            calls = {"linear": lambda w, wt: F.linear(x, w), "matmul_t": lambda w, wt: x @ wt}
            if a.inductor and m in (1, 17):
                tuned = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
                calls["inductor"] = lambda w, wt, tuned=tuned: tuned(x, w)
            for how, call in calls.items():
                for lib in ("default", "cublaslt"):
                    if lib != "default" and (m in (24, 32) or how == "inductor"):
                        continue
                    if m in (24, 32) and how != "linear":
                        continue
                    torch.backends.cuda.preferred_blas_library("cublaslt" if lib == "cublaslt" else "cublas")
                    try:
                        def fn(call=call):
                            for w, wt in zip(ws, wts):
                                call(w, wt)

                        us = graph_time_ms(fn, True) * 1e3 / copies
                        ks = _kernels(lambda call=call: call(ws[0], wts[0]))
                    finally:
                        torch.backends.cuda.preferred_blas_library("cublas")
                    row = {"weight": name, "shape": [N, K], "rows": m, "call": how, "blas": lib,
                           "us": round(us, 2), "GBps": round(N * K * 2 / us / 1e3, 1), "kernels": ks}
                    out.append(row)
                    print(f"{name:8s} M={m:2d} {how:9s} {lib:9s} {us:8.2f} µs  {row['GBps']:7.1f} GB/s  {ks}")
        ws = wts = None  # free before the next shape
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**environment(), "note": __doc__.splitlines()[0], "matmuls": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
