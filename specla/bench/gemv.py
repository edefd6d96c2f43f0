"""`specla bench gemv`: the AR step's single-row matmuls through cuBLAS, layout and shape variants.

At batch 1 an AR step is ~70% GEMV time (`bench decode --profile`), and cuBLAS reads some of
the step's weight matrices far below the copy bandwidth (in_proj ~58%, o_proj ~36% on the H200).
This times each single-row matmul of a named shape ([1, K] × a bf16 [N, K] weight) as the
model runs it (`F.linear`), and the variants a fix could pick without writing a kernel:

- `linear`: F.linear(x, W), W [N, K] (what the model does);
- `mm_kn`: x @ W' with W' [K, N] contiguous (the other cuBLAS layout, same bytes);
- `pad_M`: W's N rounded up to a multiple of M (other tilings; the extra rows are waste);
- `split`: in_proj as its [q; k; v; z] part and its a|b part (2·HV rows) in two calls;
- `triton_BN_BK_wW`: specla's own GEMV kernel (`ops.linear.triton`) at each of its tilings
  (on CPU only under Triton's interpreter).

Every variant runs over `layers` distinct weight copies inside one CUDA graph (the H200's L2
holds 50 MB: one matrix replayed alone would be served from it), so a figure is a decode
step's: µs per matmul, and the fraction of the measured copy bandwidth its weight bytes imply.
Writes `gemv.json`. On CPU (`quick`): a smoke run of the code path, the times mean nothing.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from specla.bench.common import RESULTS, copy_bandwidth, write_results
from specla.shapes import shape_config


def matmuls(cfg) -> dict[str, tuple[int, int]]:
    """(N, K) of every single-row matmul of a GDN layer and the LM head."""
    kd, vd, hv = cfg.num_heads * cfg.head_dim, cfg.num_v_heads * cfg.head_v_dim, cfg.num_v_heads
    D, I = cfg.hidden_size, cfg.intermediate_size
    return {"in_proj": (2 * kd + 2 * vd + 2 * hv, D), "o_proj": (D, vd), "gate_up": (2 * I, D),
            "down": (D, I), "lm_head": (cfg.vocab_size, D)}


def _time_us(fn, cuda: bool) -> float:
    if not cuda:
        import time

        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    import triton.testing

    from specla.graphs import capture

    return triton.testing.do_bench(capture(fn).replay, warmup=10, rep=50, return_mode="median") * 1e3


def run(shape: str = "gdn-1.3b-paper", device: str = "cuda", layers: int = 24, pads=(64, 128, 256),
        quick: bool = False, out_dir=RESULTS) -> dict:
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    cfg = shape_config(shape)
    dt = torch.bfloat16 if cuda else torch.float32
    bw = copy_bandwidth() if cuda else None
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (N, K) in matmuls(cfg).items():
        copies = 1 if name == "lm_head" or quick else layers  # the LM head alone is 2.5x the L2
        x = torch.randn(1, K, device=dev, dtype=dt, generator=g)
        ws = [torch.randn(N, K, device=dev, dtype=dt, generator=g) * K ** -0.5 for _ in range(copies)]
        variants = {"linear": (lambda ws=ws: [F.linear(x, w) for w in ws])}
        wt = [w.t().contiguous() for w in ws]
        variants["mm_kn"] = lambda wt=wt: [x @ w for w in wt]
        for m in pads:
            Np = -(-N // m) * m
            if Np != N:
                wp = [F.pad(w, (0, 0, 0, Np - N)) for w in ws]
                variants[f"pad_{m}"] = lambda wp=wp: [F.linear(x, w) for w in wp]
                del wp
        if cuda or os.environ.get("TRITON_INTERPRET") == "1":
            from specla.ops.linear import triton as linear

            for bn, bk, warps in linear.TILINGS[:2] if quick else linear.TILINGS:
                variants[f"triton_{bn}_{bk}_w{warps}"] = (
                    lambda bn=bn, bk=bk, warps=warps, ws=ws: [
                        linear.gemv(x, w, block_n=bn, block_k=bk, num_warps=warps) for w in ws])
        if name == "in_proj":
            ab = 2 * cfg.num_v_heads
            parts = [(w[:N - ab].contiguous(), w[N - ab:].contiguous()) for w in ws]
            variants["split"] = lambda parts=parts: [(F.linear(x, a), F.linear(x, b)) for a, b in parts]
        ref = F.linear(x, ws[0]).float()
        for var, fn in variants.items():
            first = fn()[0]  # every variant must compute the model's product (pads: its first N)
            first = torch.cat(first, -1) if isinstance(first, tuple) else first[..., :N]
            diff = float((first.float() - ref).abs().max() / ref.abs().max())
            us = _time_us(fn, cuda) / copies
            rows.append({"matmul": name, "N": N, "K": K, "variant": var, "us": us, "max_rel_diff": diff,
                         "bandwidth_fraction": N * K * 2 / (us * 1e-6) / bw if bw else None})
        del ws, wt, variants
        if cuda:
            torch.cuda.empty_cache()
    result = {"shape": shape, "layers": 1 if quick else layers, "copy_bandwidth_GBps": bw / 1e9 if bw else None, "rows": rows}
    _print(result)
    write_results("gemv", result, out_dir)
    return result


def _print(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"single-row matmuls, {result['shape']} (µs each, one of {result['layers']} weight copies)")
    for c in ("matmul", "N", "K", "variant", "us", "of copy bandwidth"):
        t.add_column(c)
    for r in result["rows"]:
        f = r["bandwidth_fraction"]
        t.add_row(r["matmul"], str(r["N"]), str(r["K"]), r["variant"], f"{r['us']:.2f}",
                  "-" if f is None else f"{f:.0%}")
    Console().print(t)
